"""Prefix caching that capturing and editing requests can use, and still be exact.

vLLM's prefix cache hands a new request the KV cache blocks of an earlier request whose prompt
began with the same full blocks of tokens, and computes only the positions after them. Those
cached positions never run through the model for the new request, so nothing can be read or
edited there. The rule (per request, decided from what it asks for):

- A request reads cached blocks only **before the first position it captures or edits**: every
  block that holds such a position gets a hash of its own (the request's id mixed in), so vLLM
  never finds it in the cache and computes it; the blocks before it are shared as in plain vLLM.
  A capture of the last position, of the generated tokens, or an edit there (the common cases)
  reuses the whole cached prefix; a capture of every position, an edit of every position, or a
  request that runs a dictionary recomputes everything.
- The same own-hash keeps what such a request writes out of everyone else's way: the blocks that
  hold an edited position (and every block after it, generated tokens included) carry edited keys
  and values, and no other request can ever hit them.
- Requests with no points, no edits and no dictionary share prefixes exactly as in plain vLLM.
- A prefill that runs only its first layers (:mod:`.loop`, "Running fewer layers") leaves the later
  layers' KV cache unwritten, so its blocks carry a ``cache_salt`` naming its depth: they are shared
  only by requests that run the same layers.

A request's rows are keyed by (request, position) from the model's ``positions`` argument, so a
request whose first forward starts mid-prompt at a cached prefix files its rows at the right
positions (:mod:`.worker.batch`). The block hashes are vLLM's own (a request's prefix-cache keys,
computed by the engine core's block hasher); :class:`OwnBlocks` wraps that hasher
(:func:`.compat.wrap_block_hasher`).
"""

from __future__ import annotations

import hashlib

from interp_engine.wire import WorkerRequest

#: the cache_salt of a prefill that runs layers 0 .. n - 1 only
DEPTH_SALT = "interp_engine:layers={}"


def first_needed(request: WorkerRequest) -> int | None:
    """The first position that ``request`` captures or edits, which must be computed for it
    (0: every position); None when it reads and edits nothing (plain generation)."""
    if request.empty:
        return None
    if request.features:  # a dictionary runs at (and may write) every position of its site
        return 0
    firsts = []
    if request.points:
        firsts.append(_first(request.positions, request.after))
    for chain in (request.edits or {}).values():
        firsts.extend(_first(edit.get("positions"), edit.get("after")) for edit in chain)
    return min(firsts) if firsts else None


def _first(positions, after) -> int:
    """The first position a ``(positions, after)`` selection holds (0: every position)."""
    if positions is None and after is None:
        return 0
    held = list(positions or ()) + ([after] if after is not None else [])
    return min(held) if held else 0


def depth_salt(layers: int | None) -> str | None:
    """The ``cache_salt`` of a prefill that runs ``layers`` layers (None: the whole model, no salt)."""
    return None if layers is None else DEPTH_SALT.format(layers)


class OwnBlocks:
    """vLLM's block hasher, with a request's blocks from its first needed position on hashed to
    its own values (so never found in, nor shared through, the prefix cache).

    ``rules`` maps the engine request id the backend chose (the part before vLLM's random
    suffix) to that request's first needed position; set it before ``add_request`` and drop it
    when the request is gone."""

    def __init__(self, hasher, hash_block_size: int):
        self._hasher = hasher
        self.block_size = hash_block_size
        self.rules: dict[str, int] = {}

    def __call__(self, request) -> list:
        from . import compat as vllm_compat

        new = self._hasher(request)
        if not self.rules or not new:
            return new
        rid, start = vllm_compat.hashing(request)
        first = self.rules.get(_external(rid))
        if first is None:
            return new
        return [_own(h, rid) if (start + i + 1) * self.block_size > first else h for i, h in enumerate(new)]


def _external(request_id: str) -> str:
    """The id the backend gave ``add_request`` (vLLM appends ``-<8 random characters>``)."""
    head, dash, _ = request_id.rpartition("-")
    return head if dash else request_id


def _own(block_hash: bytes, request_id: str) -> bytes:
    """A hash no other request's block can have: vLLM's, mixed with the request's unique id."""
    digest = hashlib.sha256(b"interp_engine:own:" + request_id.encode() + b":" + bytes(block_hash)).digest()
    return type(block_hash)(digest[: len(block_hash)]) if len(block_hash) <= len(digest) else type(block_hash)(digest)
