"""How many prompts one HTTP request may carry, from the limits the service publishes in ``GET /info``.

An HTTP service refuses a request over one of its :class:`~.limits.Limits` (HTTP 413). The client
reads those limits once and cuts a batch so that every request it sends fits them: at most
``max_prompts`` rows, ``max_tokens`` padded tokens, a response bounded (from the model's shapes,
as the service bounds it) by ``max_response_bytes`` and a body under ``max_request_bytes``. A
batch of any size then succeeds, whatever its caller (``run_with_cache``, ``build_dataset``'s
``shard_size``/``batch_tokens``) chose. What no cut can fix — one prompt alone over a limit, too
many points — is refused here, before anything is sent, naming the argument the caller controls.
"""

from __future__ import annotations

import dataclasses
import json

from ..address import parse_address
from ..errors import LimitExceeded, UnsafeServiceAnswer
from ..positions import width_bound
from .limits import Limits, itemsize, response_bound

#: bytes of JSON one token id may take in a request body (``123456, ``), an upper bound
TOKEN_JSON_BYTES = 8


def published(service: dict) -> Limits | None:
    """The :class:`Limits` in a service's facts (None: the service publishes none), refused when malformed."""
    raw = service.get("limits")
    if raw is None:
        return None
    names = {f.name for f in dataclasses.fields(Limits)}
    if not isinstance(raw, dict):
        raise UnsafeServiceAnswer(f"the service published limits as {type(raw).__name__}, not a mapping: refused")
    try:
        return Limits(**{k: v for k, v in raw.items() if k in names})
    except ValueError as err:
        raise UnsafeServiceAnswer(f"the service published limits this client cannot follow ({err}): refused") from None


def _over(limits: Limits, limit: str, asked: str, fix: str) -> LimitExceeded:
    return LimitExceeded(f"{asked}, over this service's limit {limit}={getattr(limits, limit)}, even alone in a "
                         f"request; {fix}, or have the service deployed with a larger limit "
                         f"(serve(..., limits=Limits({limit}=...)))")


def rows_per_request(limits: Limits, info, dtype: str, width: int, points: list[str], positions,
                     widths: dict[str, int] | None = None, body_bytes=None) -> int:
    """The most rows of a padded batch ``width`` tokens wide that one request capturing ``points``
    (their strings) at ``positions`` (a positions spec or None) may carry under ``limits``.
    ``widths``: ``{site: d_sae}`` of the call's dictionaries. ``body_bytes(rows)``: the bytes of a
    request body of that many rows, when it may come near ``max_request_bytes`` (None: the
    tokens alone decide). Raises :class:`LimitExceeded` when not even one row fits."""
    if len(points) > limits.max_points:
        raise _over(limits, "max_points", f"the call captures {len(points)} points",
                    "capture fewer points per call (points=)")
    most = limits.max_prompts
    if width > limits.max_tokens:
        raise _over(limits, "max_tokens", f"a prompt of {width} tokens", "shorten the prompt")
    most = min(most, limits.max_tokens // width)
    held = width if positions is None else min(width, width_bound(positions, width))
    per_row = response_bound([parse_address(p) for p in points], info, 1, held, width, itemsize(dtype), widths)
    if per_row > limits.max_response_bytes:
        raise _over(limits, "max_response_bytes", f"one prompt's {len(points)} points at {held} positions take "
                    f"{per_row} bytes", "capture fewer points (points=) or positions (positions=, e.g. -1: the "
                    "last token)")
    if per_row:
        most = min(most, limits.max_response_bytes // per_row)
    if body_bytes is not None and most * width * TOKEN_JSON_BYTES + 4096 > limits.max_request_bytes:
        one, two = body_bytes(1), body_bytes(2)
        row = max(0, two - one) + width * TOKEN_JSON_BYTES  # the second row's ids may be shorter than others'
        fixed = one - row
        if one > limits.max_request_bytes:
            raise _over(limits, "max_request_bytes", f"a request of one prompt takes {one} bytes",
                        "send smaller edits (edits=) or shorter prompts")
        most = min(most, max(1, (limits.max_request_bytes - fixed) // row))
    return max(1, most)


def body_size(body: dict) -> int:
    """Bytes of ``body`` as the HTTP client sends it."""
    return len(json.dumps(body).encode())
