"""How a connected model reaches a deployed service: through Ray (a Serve ``DeploymentHandle``,
:mod:`.ray_transport`) or over HTTP (the API of :mod:`.http_api`; no Ray needed, here). Both offer the same calls, with the
cluster's wire values (:class:`~interp_engine.wire.CaptureReply`, ``GenerationReply``), so the model
on top (:mod:`.client`) does not know which it uses.

Captures are idempotent, so a request that was lost — its replica died under it (Serve starts a
new one), its connection broke, or the service answered 503 because its queue was full — is sent
again, after ``Retry-After`` or a growing back-off, until it succeeds or ``retry_timeout`` passes.
A refusal of the request itself (bad input, a limit, a wrong token) is raised at once, as the
library's own error class with the service's message.

No wait is unbounded: a reply is awaited at most ``timeout`` seconds (``connect(..., timeout=)``),
which also bounds the whole of ``connect``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
from typing import Any

from .. import errors
from ..errors import InputError, InternalError, RemoteError, ServiceAuthError, ServiceError

#: how long a lost or refused-for-load request keeps being sent again
RETRY_TIMEOUT_S = 300.0
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
#: the most a client reads of ``GET /info`` (the tokenizer's files, base64, are most of it), before
#: it knows the service: whatever answers at a URL does not choose how much the client allocates
MAX_INFO_BYTES = 384 * 2**20


class Lost(Exception):
    """The request did not complete for a reason that sending it again can fix."""

    def __init__(self, why: str, retry_after: float | None = None):
        super().__init__(why)
        self.retry_after = retry_after


class Retry:
    """The back-off of one request: ``wait(lost)`` sleeps before the next try, or raises once the deadline passed."""

    def __init__(self, what: str, timeout: float = RETRY_TIMEOUT_S, deadline: float | None = None):
        self.what = what
        self.started = time.monotonic()
        self.deadline = self.started + timeout if deadline is None else min(deadline, self.started + timeout)
        self.backoff = FIRST_BACKOFF_S
        self.tries = 0

    def delay(self, lost: Lost) -> float:
        self.tries += 1
        delay = lost.retry_after if lost.retry_after is not None else self.backoff
        self.backoff = min(MAX_BACKOFF_S, self.backoff * 2)
        if time.monotonic() + delay > self.deadline:
            raise ServiceError(f"{self.what} failed {self.tries} times over {time.monotonic() - self.started:.0f}s; "
                               f"last: {lost}. Check the service: interp-engine status") from None
        return delay

    def wait(self, lost: Lost) -> None:
        time.sleep(self.delay(lost))

    async def await_(self, lost: Lost) -> None:
        await asyncio.sleep(self.delay(lost))


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a client learns once about the deployed model."""

    info: Any  # ModelInfo
    capabilities: Any  # Capabilities
    dtype: str
    tokenizer_files: dict[str, bytes]
    service: dict


# -- over HTTP ----------------------------------------------------------------------------------
class HttpTransport:
    """The HTTP API of :mod:`.http_api` with ``http.client`` (one kept-alive connection per thread)."""

    kind = "http"
    #: every request is held to the limits the service publishes (:mod:`.fit`)
    limited = True

    def __init__(self, url: str, token: str, timeout: float = 600.0, retry_timeout: float = RETRY_TIMEOUT_S):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise InputError(f"a service URL looks like http://127.0.0.1:8000/NAME, got {url!r}")
        self.url = url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.name = self.base.rsplit("/", 1)[-1]
        self._auth = f"Bearer {token}"
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self._local = threading.local()
        #: requests sent again after they were lost or refused for load
        self.resent = 0
        #: dictionaries' weights sent to replicas that asked for them (once per replica and dictionary)
        self.dictionaries_sent = 0

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return connection

    def _once(self, method: str, path: str, body: dict | None, deadline: float | None = None,
              limit: int | None = None):
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": self._auth}
        if payload is not None:
            headers["Content-Type"] = "application/json"
            if "dictionaries" in body:  # http_wire.MISSING: weights the replica asked for
                headers["X-Interp-Engine-Dictionaries"] = "1"
        connection = self._connection()
        wait = self.timeout if deadline is None else max(0.01, min(self.timeout, deadline - time.monotonic()))
        connection.timeout = wait
        if connection.sock is not None:
            connection.sock.settimeout(wait)
        try:
            connection.request(method, self.base + path, body=payload, headers=headers)
            response = connection.getresponse()
            declared = response.getheader("Content-Length", "")
            if limit is not None and declared.isdigit() and int(declared) > limit:
                data = b"x" * (limit + 1)  # refused below, unread
            else:
                data = response.read() if limit is None else response.read(limit + 1)
        except (OSError, http.client.HTTPException) as err:
            connection.close()
            self._local.connection = None
            raise Lost(f"the connection to {self.url} failed ({type(err).__name__}: {err})") from None
        if limit is not None and len(data) > limit:
            connection.close()
            self._local.connection = None
            raise errors.UnsafeServiceAnswer(f"{self.url}{path} answered more than {limit} bytes (Content-Length: "
                                             f"{declared or 'none'}); a service's answer there is far smaller: "
                                             f"refused. Check that the URL is your service")
        return response.status, response.headers, data

    def request(self, method: str, path: str, body: dict | None = None, deadline: float | None = None,
                limit: int | None = None) -> bytes:
        """The body of a 200 answer (of at most ``limit`` bytes); sent again while lost, until
        ``retry_timeout`` or ``deadline`` passes."""
        retry = Retry(f"{method} {self.url}{path}", self.retry_timeout, deadline)
        while True:
            try:
                status, headers, data = self._once(method, path, body, retry.deadline if deadline else None, limit)
                return self._answer(status, headers, data, path)
            except Lost as lost:
                retry.wait(lost)
                self.resent += 1

    def _answer(self, status: int, headers, data: bytes, path: str) -> bytes:
        if status == 200:
            return data
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        ours = isinstance(answer, dict) and "error" in answer and "message" in answer
        if status == 503 or (status in (500, 502, 504) and not ours):
            after = headers.get("Retry-After")
            raise Lost(f"HTTP {status} from {self.url}{path}: {data[:200].decode(errors='replace')}",
                       float(after) if after and after.isdigit() else None)
        if status in (401, 403):
            raise ServiceAuthError(answer["message"] if ours else f"HTTP {status} from {self.url}{path}")
        if status == 404 and not ours:
            raise ServiceError(f"{self.url}{path} answered 404: no such service or path (is {self.name!r} deployed? "
                               f"interp-engine status lists the services)")
        if status == 422 and isinstance(answer, dict) and "detail" in answer:
            raise InputError(f"the service refused the request's form: {json.dumps(answer['detail'])[:2000]}")
        if status == 409 and ours and answer["error"] == "MissingDictionary":
            raise errors.MissingDictionary(answer["message"], answer.get("keys", []))
        if ours:
            cls = getattr(errors, answer["error"], None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(answer["message"])
            raise RemoteError(f"{answer['error']}: {answer['message']}")
        raise RemoteError(f"HTTP {status} from {self.url}{path}: {data[:500].decode(errors='replace')}")

    def facts(self) -> Facts:
        import base64

        from ..points import ModelInfo
        from ..capabilities import Capabilities

        answer = json.loads(self.request("GET", "/info", deadline=time.monotonic() + self.timeout,
                                         limit=MAX_INFO_BYTES))
        model = answer["model"]
        info = ModelInfo(**{**model, "sites": frozenset(model["sites"]), "moe_layers": tuple(model["moe_layers"])})
        caps = answer["capabilities"]
        capabilities = Capabilities(**{**caps, "writable": frozenset(caps["writable"]),
                                       "unserved": frozenset(caps["unserved"])})
        files = {k: base64.b64decode(v) for k, v in answer["tokenizer_files"].items()}
        return Facts(info, capabilities, answer["dtype"], files, answer["service"])

    @staticmethod
    def _body(tokens, points, positions, edits, saes) -> dict:
        from ..wire import spec_to_json
        from .http_wire import edits_to_json

        body = {"tokens": tokens.tolist(), "points": list(points), "positions": spec_to_json(positions),
                "edits": edits_to_json(edits)}
        if saes:
            body["saes"] = [key for key, _ in saes]
        return body

    def dictionaries(self, plan) -> list:
        """``[(key, dictionary)]`` of a call's dictionaries (a checked ``FeaturePlan``). A request
        names them by key; a replica that does not hold one yet answers 409 with the keys it
        lacks, and the request is sent again once with those dictionaries' weights."""
        return [(a.dictionary.key, a.dictionary) for a in plan.attached]

    def _capture(self, path: str, body: dict, saes):
        from .http_wire import MISSING, decode_capture, dictionary_to_json

        try:
            return decode_capture(self.request("POST", path, body))
        except errors.MissingDictionary as missing:
            if not saes or not set(missing.keys) <= {key for key, _ in saes}:
                raise InternalError(f"[Internal] the service asked for dictionaries {missing.keys} this request "
                                    f"did not name") from None
        # every one of the call's dictionaries: whichever replica takes the request then has them all
        sent = {key: dictionary_to_json(d) for key, d in saes}
        self.dictionaries_sent += len(sent)
        return decode_capture(self.request("POST", path, {**body, MISSING: sent}))

    def run(self, tokens, points, positions=None, edits=None, saes=None):
        return self._capture("/capture", self._body(tokens, points, positions, edits, saes), saes)

    def generate(self, tokens, points, options, positions=None, edits=None, saes=None):
        return self._capture("/generate", {**self._body(tokens, points, positions, edits, saes), **options}, saes)

    async def arun(self, tokens, points, positions=None, edits=None, saes=None):
        from .. import cancel

        return await cancel.in_thread(self.run, tokens, points, positions, edits, saes)

    async def agenerate(self, tokens, points, options, positions=None, edits=None, saes=None):
        from .. import cancel

        return await cancel.in_thread(self.generate, tokens, points, options, positions, edits, saes)

    def o_proj_weight(self, layer: int):
        from .http_wire import decode_tensors

        return decode_tensors(self.request("GET", f"/o_proj/{int(layer)}"))[0]["weight"]

    def unembed_weights(self):
        from ..unembedding import UnembedWeights
        from .http_wire import decode_tensors

        tensors, metadata = decode_tensors(self.request("GET", "/unembedding"))
        norm = {k.removeprefix("norm."): v for k, v in tensors.items() if k.startswith("norm.")}
        return UnembedWeights(json.loads(metadata["config"]), metadata["norm_path"], norm, tensors["weight"])

    def weights_sha256(self) -> str:
        return json.loads(self.request("GET", "/fingerprint"))["weights_sha256"]

    def ping(self) -> int:
        return json.loads(self.request("GET", "/ping"))["pid"]

    def status(self) -> dict:
        return json.loads(self.request("GET", "/status"))
