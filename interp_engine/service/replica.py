"""One replica of a deployed model: the Ray Serve deployment class.

Each Serve replica loads the model once (:class:`~interp_engine.actors.replica.ReplicaCore`, the
same code as a cluster model's replica) and answers two kinds of caller:

- Ray clients (``connect(name)``) call its methods through a Serve ``DeploymentHandle``: ``run``,
  ``generate``, ``facts`` ... with the cluster's wire format (:mod:`interp_engine.wire`);
- HTTP clients reach it through Serve's proxy: the FastAPI routes of :mod:`.http_api`, mounted
  with ``serve.ingress``.

Captures run on worker threads, several at once (``max_ongoing_requests``): the eager backend
takes one forward at a time (its own lock), a vLLM engine batches concurrent requests itself.
A caller that goes away (a cancelled handle call, a closed HTTP connection) stops its capture at
the next checkpoint (:mod:`interp_engine.cancel`).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading

from ray import serve

from ..actors.replica import ReplicaCore, ReplicaSpec
from ..wire import CaptureReply, GenerationReply
from ..address import parse_address
from ..errors import InputError
from ..points import check_points
from ..wire import Packed
from ..positions import width_bound
from . import compat
from .identity import check as check_identity
from .identity import identity as identity_of
from .http_api import app
from .limits import Limits, itemsize, response_bound


class _Core(ReplicaCore):
    """A replica core whose captures stop when the caller of the thread running them gives up."""

    _local = threading.local()

    @classmethod
    def stop_check(cls) -> bool:
        stop = getattr(cls._local, "stop", None)
        return stop is not None and stop.is_set()


@serve.ingress(app)
class CaptureReplica:
    def __init__(self, spec: ReplicaSpec, token_sha256: str, limits: Limits, service: dict):
        import ray

        compat.bind_node_address()  # before Serve starts this replica's gRPC server
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.core = _Core(spec, 0, ray.get_runtime_context().get_node_id())
        self.token_sha256 = token_sha256
        self.limits = limits
        self.service = dict(service)

    @property
    def model(self):
        return self.core.model

    async def _in_thread(self, fn, *args):
        """``fn(*args)`` on a worker thread; cancelling the awaiting task stops it at its next checkpoint."""
        stop = threading.Event()

        def watched():
            _Core._local.stop = stop
            try:
                return fn(*args)
            finally:
                _Core._local.stop = None

        try:
            return await asyncio.to_thread(watched)
        except asyncio.CancelledError:
            stop.set()
            raise

    # -- what Ray clients call (through a DeploymentHandle) -------------------------------------
    async def identity(self) -> dict:
        """This deployment's identity (:mod:`.identity`); the weights hashed once."""
        if "_identity" not in self.__dict__:
            try:
                weights = await self._in_thread(self.core.weights_sha256)
            except NotImplementedError:  # a model without a local folder to hash
                weights = None
            self._identity = identity_of(self.service, self.model.dtype, weights)
        return self._identity

    async def checked(self, expected: dict, method: str, *args):
        """``method(*args)`` if the caller connected to this deployment (``expected``, its
        identity); ``ServiceChanged`` naming what differs otherwise."""
        check_identity(expected, await self.identity(), self.service.get("name", "?"))
        if method.startswith("_"):
            raise InputError(f"a service replica has no call {method!r}")
        answer = getattr(self, method)(*args)
        return await answer if inspect.isawaitable(answer) else answer

    async def facts(self):
        return await self._in_thread(self.core.facts)

    async def describe(self) -> dict:
        """The service's own facts (name, url, model, backend, limits) and this replica's id, pid and Ray node."""
        return {**self.service, "replica": self.replica_id, "pid": os.getpid(), "node": self.core.node}

    async def run(self, tokens, points, positions=None, edits=None, saes=None) -> CaptureReply:
        return await self._in_thread(self.core.run, tokens, points, positions, edits, saes)

    async def generate(self, tokens, points, options: dict, positions=None, edits=None,
                       saes=None) -> GenerationReply:
        return await self._in_thread(self.core.generate, tokens, points, options, positions, edits, saes)

    def missing_dictionaries(self, keys: list[str]) -> list[str]:
        """Those of ``keys`` this replica holds no dictionary for (an HTTP client then sends them)."""
        held = self.core.__dict__.get("_dictionaries", {})
        return [key for key in keys if key not in held]

    def feature_widths(self, keys: list[str], given: dict) -> dict[str, int]:
        """``{site: d_sae}`` of the dictionaries ``keys`` (held here, or ``given`` by key)."""
        held = {**self.core.__dict__.get("_dictionaries", {}), **given}
        return {str(held[key].reads): held[key].d_sae for key in keys}

    async def write_shard(self, spec, index: int, texts: list[str]):
        return await self._in_thread(self.core.write_shard, spec, index, texts)

    async def o_proj_weight(self, layer: int) -> Packed:
        return await self._in_thread(self.core.o_proj_weight, layer)

    async def unembed_weights(self) -> dict:
        return await self._in_thread(self.core.unembed_weights)

    async def weights_sha256(self) -> str:
        return await self._in_thread(self.core.weights_sha256)

    async def ping(self) -> int:
        return os.getpid()

    # -- what the HTTP routes call --------------------------------------------------------------
    def checked_points(self, points: list[str]) -> list[str]:
        """The addresses ``points`` names (site names expand to every layer), checked against the model."""
        return [str(a) for a in check_points(points, self.model.info, self.model.capabilities)]

    def check_limits(self, tokens, points: list[str], positions=None, new_tokens: int = 0,
                     widths: dict[str, int] | None = None) -> None:
        """Refuse (HTTP 413) a request over a limit, its response size bounded from the model's shapes
        (a feature point's from ``widths``, its dictionary's feature count by site)."""
        rows, width = tokens.shape
        self.limits.check_request(rows, width, len(points), new_tokens)
        total = width + new_tokens
        held = total if positions is None else min(total, width_bound(positions, total))
        bound = response_bound([parse_address(p) for p in points], self.model.info, rows, held, total,
                               itemsize(self.model.dtype), widths or {})
        self.limits.check_response(bound, "a response that may reach")

    async def info_json(self) -> dict:
        """What ``GET /info`` answers: :meth:`facts` and :meth:`describe` as JSON."""
        import base64
        import dataclasses

        facts = await self.facts()
        return {"service": await self.describe(), "model": _plain(dataclasses.asdict(facts.info)),
                "capabilities": _plain(dataclasses.asdict(facts.capabilities)), "dtype": facts.model_dtype,
                "tokenizer_files": {k: base64.b64encode(v).decode() for k, v in facts.tokenizer_files.items()}}


def _plain(data: dict) -> dict:
    """Sets and tuples as sorted / ordered lists (JSON has neither)."""
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else list(v) if isinstance(v, tuple) else v
            for k, v in data.items()}
