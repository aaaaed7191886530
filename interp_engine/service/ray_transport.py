"""How a connected model reaches a deployed service through Ray: a Serve ``DeploymentHandle``
(any process connected to the cluster), with the retries of :mod:`.transport`.

No wait is unbounded: a reply is awaited at most ``timeout`` seconds, and every
:data:`ALIVE_CHECK_S` the client checks that the service still exists (a shut-down service is an
error, not a hang). Every call names the deployment the client connected to (:mod:`.identity`):
a replica of another deployment under the same name refuses it with ``ServiceChanged`` instead of
answering with another model.
"""

from __future__ import annotations

import asyncio
import time

from .. import errors
from ..errors import InternalError, ServiceError
from .transport import RETRY_TIMEOUT_S, Facts, Lost, Retry

#: how often a Ray client waiting for a reply checks that its service still exists
ALIVE_CHECK_S = 5.0


class RayTransport:
    """Calls on the deployment's replicas through a Serve ``DeploymentHandle`` (any process connected
    to the cluster); Serve picks the replica and queues the call. Every call goes through the
    replica's ``checked`` with the identity this client connected to."""

    kind = "ray"
    #: a Ray call is held to no per-request limits (those guard the HTTP API)
    limited = False

    def __init__(self, name: str, retry_timeout: float = RETRY_TIMEOUT_S, timeout: float = 600.0):
        from ray import serve

        from .status import DEPLOYMENT

        self.name = name
        self.retry_timeout = retry_timeout
        self.timeout = timeout
        self.handle = serve.get_deployment_handle(DEPLOYMENT, app_name=name)
        #: the deployment this client talks to (:mod:`.identity`); set by :meth:`facts`
        self.identity: dict | None = None
        #: requests sent again after they were lost or refused for load
        self.resent = 0

    def _lost(self, err: BaseException) -> Lost | None:
        from ray.exceptions import ActorUnavailableError, RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        if isinstance(err, BackPressureError):
            return Lost(f"the service's queue is full ({err})", err.retry_after_s)
        if isinstance(err, (RayActorError, ActorUnavailableError, ReplicaUnavailableError)):
            return Lost(f"its replica was lost ({type(err).__name__})")
        if isinstance(err, DeploymentUnavailableError):
            return Lost(f"it is unavailable ({err.message})")
        return None

    def _retryable(self, err: Exception) -> Lost:
        """What a failed reply means: a :class:`Lost` to send again after, or raised: the
        replica's own error as the user's error, anything else as it is."""
        from ray.exceptions import RayTaskError

        if isinstance(err, RayTaskError):
            cause = getattr(err, "cause", None)
            lost = self._lost(cause) if isinstance(cause, BaseException) else None
            if lost is None:
                raise errors.user_error(err) from None
            return lost
        lost = self._lost(err)
        if lost is None:
            raise err
        return lost

    def check_alive(self) -> None:
        """Raise ``ServiceError`` when the service is no longer deployed on the cluster (a Serve
        controller that cannot answer now, e.g. while it restarts, proves nothing: no error)."""
        from ray import serve

        try:
            running = serve.status().applications
        except Exception:
            return
        if self.name not in running:
            raise ServiceError(f"service {self.name!r} is gone from this cluster (shut down?); running: "
                               f"{', '.join(sorted(running)) or 'none'}. Deploy it again and connect again: "
                               f"connect({self.name!r})")

    def _send(self, method: str, args: tuple):
        if method == "identity":
            return self.handle.identity.remote()
        if self.identity is None:
            raise InternalError(f"[Internal] {method} on service {self.name!r} before its identity is known")
        return self.handle.checked.remote(self.identity, method, *args)

    def _result(self, response, what: str, deadline: float):
        """The reply of ``response``, waited for until ``deadline``, checking the service is still
        there every :data:`ALIVE_CHECK_S`; cancelled and an error when either fails."""
        from ray.exceptions import RayTaskError

        while True:
            left = deadline - time.monotonic()
            try:
                return response.result(timeout_s=max(0.01, min(ALIVE_CHECK_S, left)))
            except TimeoutError as err:
                if isinstance(err, RayTaskError):  # the replica's own error (RayTaskError subclasses its cause)
                    raise
            try:
                if time.monotonic() >= deadline:
                    raise ServiceError(f"{what} got no reply within {self.timeout:g}s (connect(..., timeout=...) "
                                       f"sets it). Check the service: interp-engine status {self.name}")
                self.check_alive()
            except BaseException:
                response.cancel()
                raise

    def call(self, method: str, *args):
        return self._call(method, args)

    def _call(self, method: str, args: tuple, deadline: float | None = None):
        what = f"{method} on service {self.name!r}"
        retry = Retry(what, self.retry_timeout, deadline)
        while True:
            response = self._send(method, args)
            try:
                return self._result(response, what, min(time.monotonic() + self.timeout, retry.deadline))
            except KeyboardInterrupt:
                response.cancel()
                raise
            except Exception as err:
                lost = self._retryable(err)
            self.check_alive()
            retry.wait(lost)
            self.resent += 1

    async def _aresult(self, response, what: str, deadline: float):
        """:meth:`_result` for ``await``: the event loop keeps running while it waits."""
        async def reply():
            return await response

        task = asyncio.ensure_future(reply())
        try:
            while True:
                left = deadline - time.monotonic()
                done, _ = await asyncio.wait({task}, timeout=max(0.01, min(ALIVE_CHECK_S, left)))
                if done:
                    return task.result()
                if time.monotonic() >= deadline:
                    raise ServiceError(f"{what} got no reply within {self.timeout:g}s (connect(..., timeout=...) "
                                       f"sets it). Check the service: interp-engine status {self.name}")
                await asyncio.to_thread(self.check_alive)
        except BaseException:
            if not task.done():
                task.cancel()
                response.cancel()
            raise

    async def acall(self, method: str, *args):
        what = f"{method} on service {self.name!r}"
        retry = Retry(what, self.retry_timeout)
        while True:
            response = self._send(method, args)
            try:
                return await self._aresult(response, what, min(time.monotonic() + self.timeout, retry.deadline))
            except Exception as err:
                lost = self._retryable(err)
            await asyncio.to_thread(self.check_alive)
            await retry.await_(lost)
            self.resent += 1

    def facts(self) -> Facts:
        """What the model needs to know, and the identity every later call is checked against; all
        within ``timeout``."""
        deadline = time.monotonic() + self.timeout
        self.identity = self._call("identity", (), deadline)
        replica = self._call("facts", (), deadline)
        return Facts(replica.info, replica.capabilities, replica.model_dtype, replica.tokenizer_files,
                     self._call("describe", (), deadline))

    def dictionaries(self, plan) -> list:
        """``[(key, object ref)]`` of a call's dictionaries, each put in the object store once; a
        replica fetches and keeps each by key, as a cluster replica does."""
        from ..features.transfer import put_dictionaries

        return put_dictionaries(plan, self.__dict__.setdefault("_dictionaries", {}))

    def run(self, tokens, points, positions=None, edits=None, saes=None):
        return self.call("run", tokens, points, positions, edits, saes)

    def generate(self, tokens, points, options, positions=None, edits=None, saes=None):
        return self.call("generate", tokens, points, options, positions, edits, saes)

    async def arun(self, tokens, points, positions=None, edits=None, saes=None):
        return await self.acall("run", tokens, points, positions, edits, saes)

    async def agenerate(self, tokens, points, options, positions=None, edits=None, saes=None):
        return await self.acall("generate", tokens, points, options, positions, edits, saes)

    def o_proj_weight(self, layer: int):
        return self.call("o_proj_weight", layer).tensor()

    def unembed_weights(self):
        from ..unembedding import UnembedWeights

        return UnembedWeights.from_plain(self.call("unembed_weights"))

    def weights_sha256(self) -> str:
        return self.call("weights_sha256")

    def ping(self) -> int:
        return self.call("ping")

    def status(self) -> dict:
        from .status import service_status

        return service_status(self.name)
