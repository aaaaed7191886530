"""What one HTTP request may ask of the service, what a replica holds for its clients, and the
checks that refuse more (HTTP 413).

A request over a limit is refused before any work, with a :class:`~interp_engine.errors.LimitExceeded`
that names the limit, its value, what the request asked for and how to fit. Every count is checked
on the parsed request before anything is built from it (no array is padded, no tensor decoded,
before its size is known to fit). The response size is bounded from the model's shapes before the
capture runs (every point at every position the request can produce), and measured again on the
result. A request body is received before the request takes one of the replica's capture slots,
within a deadline that a slow sender misses (HTTP 408).
"""

from __future__ import annotations

import dataclasses

from ..address import SITES, Address, FeatureAddress
from ..points import ModelInfo
from ..errors import LimitExceeded
from ..scalars import integer


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request limits of a deployed service (``serve(..., limits=Limits(...))``)."""

    #: prompts (rows) in one request
    max_prompts: int = 64
    #: prompt tokens in one request (rows x padded width)
    max_tokens: int = 65536
    #: addresses one request captures (after expanding site names)
    max_points: int = 512
    #: ``max_tokens`` of one generation
    max_new_tokens: int = 1024
    #: bytes of activations one response carries
    max_response_bytes: int = 512 * 2**20
    #: bytes of one request body (edit vectors travel in it)
    max_request_bytes: int = 64 * 2**20
    #: bytes of dictionaries' weights one request may carry besides (sent once per replica, see
    #: docs/SERVICE.md: a 16k-feature SAE on a 4096-wide residual is 512 MiB in float32)
    max_dictionary_bytes: int = 2**30
    #: edits (edit objects, over every address) in one request
    max_edits: int = 256
    #: bytes of uploaded dictionaries' weights one replica keeps (the least recently used are
    #: dropped beyond it; a client whose dictionary was dropped is asked for it again, HTTP 409)
    max_dictionary_memory_bytes: int = 4 * 2**30
    #: request bodies one replica receives at once, beside the requests it runs
    #: (``max_ongoing_requests``): a slow sender holds one of these, never a capture slot
    max_uploads: int = 32
    #: seconds a request body may take before it must keep up with ``min_upload_bytes_per_s``
    upload_grace_s: int = 10
    #: the slowest a request body may arrive once its grace is over (HTTP 408 below it)
    min_upload_bytes_per_s: int = 2**20

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            number = integer(value)
            if number is None or number < 1:
                raise ValueError(f"Limits.{field.name} must be a positive int, got {value!r}")
            object.__setattr__(self, field.name, number)  # np.int64(8), torch.tensor(8): a plain int

    def refuse(self, limit: str, asked, fix: str) -> LimitExceeded:
        return LimitExceeded(f"the request asks for {asked}, over this service's limit {limit}="
                             f"{getattr(self, limit)}; {fix}")

    def check_request(self, rows: int, width: int, points: int, new_tokens: int = 0, edits: int = 0) -> None:
        """Refuse a request of ``rows`` prompts padded to ``width`` tokens, ``points`` addresses,
        ``new_tokens`` to generate and ``edits`` edit objects, where one is over its limit."""
        if rows > self.max_prompts:
            raise self.refuse("max_prompts", f"{rows} prompts", "send fewer prompts per request")
        if rows * width > self.max_tokens:
            raise self.refuse("max_tokens", f"{rows * width} prompt tokens ({rows} x {width}, rows padded to "
                              f"the longest)", "send fewer or shorter prompts per request, or prompts of like length")
        if points > self.max_points:
            raise self.refuse("max_points", f"{points} points", "capture fewer points per request")
        if new_tokens > self.max_new_tokens:
            raise self.refuse("max_new_tokens", f"max_tokens={new_tokens}", "generate fewer tokens per request")
        if edits > self.max_edits:
            raise self.refuse("max_edits", f"{edits} edits", "send fewer edits per request")

    def check_response(self, nbytes: int, what: str = "the response") -> None:
        if nbytes > self.max_response_bytes:
            raise self.refuse("max_response_bytes", f"{what} of {nbytes} bytes",
                              "capture fewer points or positions (positions=) per request")


def _per_row(address: Address | FeatureAddress, info: ModelInfo, positions: int, total: int,
             widths: dict[str, int]) -> int:
    """Elements of one row of ``address``'s tensor holding ``positions`` of ``total`` positions
    (a feature point: its ids, or every feature of the dictionary at its site, from ``widths``)."""
    if isinstance(address, FeatureAddress):
        if address.kind != "features":  # the error term has its site's width
            return _per_row(address.site, info, positions, total, widths)
        return positions * (len(address.ids) if address.ids is not None else widths.get(str(address.site), 0))
    heads = {"z": info.n_heads, "q": info.n_heads, "k": info.n_kv_heads, "v": info.n_kv_heads,
             **{f"q_norm_{io}": info.n_heads for io in ("in", "out")},
             **{f"k_norm_{io}": info.n_kv_heads for io in ("in", "out")}}
    if address.name in heads:
        return positions * heads[address.name] * max(info.d_head, info.d_head_qk)
    shape = SITES[address.name].shape
    if len(SITES[address.name].position_axes) > 1:  # pattern, attn_scores: [heads, q, k]
        return info.n_heads * positions * total
    if "d_mlp" in shape:
        return positions * info.d_mlp
    if "vocab" in shape:  # logits, lm_head
        return positions * info.d_vocab
    if address.name == "router_logits":
        return positions * info.n_experts
    if address.name in ("expert_weights", "expert_indices"):
        return positions * info.top_k
    return positions * info.d_model


def response_bound(addresses: list[Address | FeatureAddress], info: ModelInfo, rows: int, positions: int, total: int,
                   itemsize: int, widths: dict[str, int] | None = None) -> int:
    """At most how many bytes a capture of ``addresses`` returns for ``rows`` rows that hold
    ``positions`` of ``total`` positions each (8 bytes an element for the int64 expert indices;
    4 for feature activations, float32). ``widths``: ``{site: d_sae}`` of the call's dictionaries."""
    def size(a) -> int:
        if isinstance(a, FeatureAddress):
            return 4
        return 8 if a.name == "expert_indices" else itemsize

    return sum(rows * _per_row(a, info, positions, total, widths or {}) * size(a) for a in addresses)


def itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)

