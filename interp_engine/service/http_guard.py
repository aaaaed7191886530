"""What every HTTP request passes before a route sees it: the ASGI middleware :class:`Guard`.

In order: the bearer token (401 without, 403 with a wrong one, compared in constant time,
:mod:`.auth`); the body's declared size (411 without ``Content-Length``, 413 over
``max_request_bytes``, or over ``max_request_bytes + max_dictionary_bytes`` for a request that
carries dictionaries' weights); the body itself, received whole within a deadline (408 for a
sender that falls below ``min_upload_bytes_per_s`` once ``upload_grace_s`` is over); for a body
with dictionaries, what is not dictionaries' weights under ``max_request_bytes`` (413, before the
body is parsed); and only then one of the replica's capture slots (503 + ``Retry-After`` when
``max_queued_requests`` requests already wait for one). A slow sender therefore holds one of the
replica's ``max_uploads`` receiving places, never a slot a capture needs.

Serve counts a request against ``max_ongoing_requests`` from the moment the proxy hands it to the
replica, before its body has arrived (Ray Serve 2.60: the replica pulls the body from the proxy,
``ASGIReceiveProxy``), so the deployment is given ``max_ongoing_requests + max_uploads`` there
(:mod:`.app`) and the replica's own slots (:class:`Slots`) bound the requests that run.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

from fastapi.responses import JSONResponse

from .auth import matches

#: the header of a request that carries dictionaries' weights (its body may be larger by
#: ``Limits.max_dictionary_bytes``)
DICTIONARIES_HEADER = b"x-interp-engine-dictionaries"
#: the longest message an error body carries
MESSAGE_CHARS = 2000
#: Serve's per-replica concurrency: requests a replica runs at once (the eager backend still
#: takes one forward at a time; a vLLM engine batches them)
MAX_ONGOING = 8
#: requests a caller (a proxy, a client's handle) may queue before it is answered 503 + Retry-After
MAX_QUEUED = 64
RETRY_AFTER_S = 1
#: a JSON member whose value is one string of base64 (``"key": "<base64>"``): what a dictionary
#: upload is made of; only such strings may use ``max_dictionary_bytes``
_BASE64_MEMBER = re.compile(rb'"[^"\\]{1,256}"\s*:\s*"[A-Za-z0-9+/]*={0,2}"')


def error(status: int, kind: str, message: str, headers: dict | None = None, **extra) -> JSONResponse:
    """The JSON error body every refusal has: ``{"error": <class>, "message": <text>}``, the
    message cut to :data:`MESSAGE_CHARS` (a message never quotes a request's values in full)."""
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS - 20] + f"... ({len(message)} chars)"
    return JSONResponse({"error": kind, "message": message, **extra}, status_code=status, headers=headers)


class Busy(Exception):
    """Every capture slot is taken and ``max_queued_requests`` requests wait for one already."""


class Slots:
    """The requests a replica runs at once (``max_ongoing_requests``), and how many may wait for
    one (``max_queued_requests``; -1: any number). Created on the replica's event loop."""

    def __init__(self, size: int, queue: int):
        self.size, self.queue = size, queue
        self.waiting = 0
        self._semaphore: asyncio.Semaphore | None = None

    @contextlib.asynccontextmanager
    async def take(self, bounded: bool = True):
        """Hold one slot for the block; :class:`Busy` at once when ``bounded`` and the queue is full."""
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.size)
        if self._semaphore.locked() and bounded and 0 <= self.queue <= self.waiting:
            raise Busy()
        self.waiting += 1
        try:
            await self._semaphore.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._semaphore.release()


def refused(owner, headers: dict[bytes, bytes], method: str) -> JSONResponse | None:
    """The answer to a request without this deployment's bearer token, or whose body's declared
    size is over its limit; None for one that may go on."""
    header = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = header.partition(" ")
    if not header:
        return error(401, "ServiceAuthError", "this service needs a bearer token: send 'Authorization: Bearer "
                     "<token>' (serve() returned it as info.token and stored it in a file only you can read)",
                     {"WWW-Authenticate": "Bearer"})
    if scheme.lower() != "bearer" or not matches(token.strip(), owner.token_sha256):
        return error(403, "ServiceAuthError", "the bearer token is not this service's; use the token serve() "
                     "returned for it (info.token, or its token file)")
    if method == "POST":
        size = headers.get(b"content-length")
        if size is None or not size.isdigit():
            return error(411, "InputError", "send the request body with a Content-Length header")
        limits = owner.limits
        uploads = DICTIONARIES_HEADER in headers
        if int(size) > limits.max_request_bytes + (limits.max_dictionary_bytes if uploads else 0):
            limit = "max_dictionary_bytes" if uploads else "max_request_bytes"
            return error(413, "LimitExceeded", str(limits.refuse(
                limit, f"a body of {int(size)} bytes", "send smaller dictionaries" if uploads
                else "send smaller edits or fewer prompts")))
    return None


async def received(owner, size: int, receive) -> bytes | JSONResponse | None:
    """The request's body of ``size`` bytes, received within its deadline: by ``upload_grace_s``
    plus one second per ``min_upload_bytes_per_s`` bytes received so far, more must have come.
    A 408 or 400 answer for a body that is too slow or not ``size`` bytes; None if the client left."""
    limits = owner.limits
    loop = asyncio.get_running_loop()
    start, chunks, got = loop.time(), [], 0
    while True:
        wait = start + limits.upload_grace_s + got / limits.min_upload_bytes_per_s - loop.time()
        try:
            if wait <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), wait)
        except (TimeoutError, asyncio.TimeoutError):
            return error(408, "InputError", f"the request body came too slowly: {got} of {size} bytes after "
                         f"{loop.time() - start:.0f}s; this service takes bodies at {limits.min_upload_bytes_per_s} "
                         f"bytes/s or faster after {limits.upload_grace_s}s (Limits.min_upload_bytes_per_s, "
                         f"upload_grace_s): send the whole body at once")
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        got += len(chunk)
        if got > size:
            return error(400, "InputError", f"the request body is longer than its Content-Length ({size} bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if got != size:
        return error(400, "InputError", f"the request body ended after {got} of its Content-Length {size} bytes")
    return b"".join(chunks)


def outside_uploads(body: bytes) -> int:
    """Bytes of ``body`` (JSON) outside its ``"key": "<base64>"`` members: a bound, found without
    parsing, on what is not dictionaries' weights (only strings may take the larger bound; a
    string parses to its own size, lists of numbers to many times theirs)."""
    return len(body) - sum(m.end() - m.start() for m in _BASE64_MEMBER.finditer(body))


def replayed(body: bytes, receive):
    """An ASGI ``receive`` that gives ``body`` whole, then what ``receive`` gives (the disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Guard:
    """ASGI middleware: authenticate, receive the body within its deadline, then take a capture
    slot (see the module doc); every path (the schema and /docs too) needs the bearer token."""

    def __init__(self, inner, replica):
        self.inner = inner
        self.replica = replica

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        owner = self.replica()
        headers = dict(scope["headers"])
        refusal = refused(owner, headers, scope["method"])
        if refusal is None and scope["method"] == "POST":
            size = int(headers[b"content-length"])
            body = await received(owner, size, receive)
            if body is None:
                return None  # the client left; nobody to answer
            if isinstance(body, JSONResponse):
                refusal = body
            elif DICTIONARIES_HEADER in headers and size > owner.limits.max_request_bytes:
                rest = outside_uploads(body)
                if rest > owner.limits.max_request_bytes:
                    refusal = error(413, "LimitExceeded", str(owner.limits.refuse(
                        "max_request_bytes", f"a body of {rest} bytes besides dictionaries' weights",
                        "send smaller edits or fewer prompts")))
            receive = replayed(body, receive) if refusal is None else receive
        if refusal is not None:
            return await refusal(scope, receive, send)
        try:
            async with owner.slots.take():
                await self.inner(scope, receive, send)
        except Busy:
            await error(503, "ServiceBusy", f"every capture slot of this replica is taken and {owner.slots.waiting} "
                        f"requests wait for one: send the request again after Retry-After seconds",
                        {"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
