"""Edits inside a vLLM worker: each request's own edits, applied to its own rows of the flat batch.

A request is registered with its edits as plain data (:func:`interp_engine.wire.edit_for_worker`: kind,
numbers, lists; no code crosses). In each forward the recorder's row map says which rows of the
flat batch are which request's positions; an edit changes only the rows of the requests that
carry it, at the positions they asked for, so requests without edits that share the batch run
exactly as they would alone.

Sites are found through the vLLM site table (``Arch.vllm``, :mod:`interp_engine.archs.vllm_reads`). Where a
site is the sum of several tensors (``resid_pre`` = ``hidden_states + residual``, ``resid_post``
= ``out[0] + out[1]``: vLLM fuses the residual add into the next norm) the edit is written to the
last part: ``last' = edited(sum) - others``, so the next fused add sees the edited residual and
the other parts (``mlp_out_post`` is ``out[0]``) are left as computed. ``resid_mid`` is written, as on
the eager backend, through what attention adds: ``attn_out_post' = edited(resid_pre + attn_out_post) -
resid_pre``.

Under tensor parallelism the replicated sites are edited alike on every rank; the sharded ones
(``z``, ``mlp_post``, ``q``, ``k``, ``v``) edit this rank's block: its heads (or columns) of the
edit's heads and tensors.

Written against vLLM 0.32.0 (the same internals as :mod:`.hooks`).
"""

from __future__ import annotations

import dataclasses

import torch

from interp_engine.address import Address, parse_address
from interp_engine.errors import InternalError
from interp_engine.edit_directions import DIRECTIONAL
from interp_engine.edits import Add, Set, apply_edit
from interp_engine.wire import edit_from_worker

@dataclasses.dataclass(eq=False)
class _Entry:
    """One edit as registered: the edit, the prompt positions it edits (None: all), the first
    generated position it edits (None: none unless all), and how many requests hold it."""

    edit: object
    wanted: torch.Tensor | None
    after: int | None
    key: tuple
    holders: int = 0
    #: the edit's vector / value holds one block per position of ``wanted``, in that order
    per_position: bool = False


def _key(data: dict) -> tuple:
    """Equal edits at equal positions share an entry (the digest stands for the edit's values)."""
    positions = data.get("positions")
    return data["digest"], None if positions is None else tuple(positions), data.get("after")


class EditBook:
    """The registered requests' edits on one worker, and which rows of this forward they touch.

    Requests that carry the same edit (the same steering vector on many prompts) share one
    entry, so each forward applies it once to all their rows together."""

    def __init__(self, table, info: dict, tp_rank: int = 0, tp_size: int = 1):
        self.table = table
        self.info = info  # n_heads, n_kv_heads, d_head, d_mlp (whole model)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # request -> address -> its entries, in the order they apply
        self.edits: dict[str, dict[Address, list[_Entry]]] = {}
        # the edit's wire form -> the entry every request with that edit shares
        self._shared: dict[tuple, _Entry] = {}
        # this forward: (request, first row, end row) of the requests with edits
        self.spans: list[tuple[str, int, int]] = []
        self.positions = torch.empty(0, dtype=torch.long)
        self._resid_pre: dict[int, torch.Tensor] = {}
        self._rows_of: dict[tuple, torch.Tensor] = {}
        self._local: dict[tuple, object] = {}

    def register(self, rid: str, edits: dict) -> None:
        book = {}
        for point, chain in edits.items():
            book[parse_address(point)] = [self._entry(data) for data in chain]
        self.edits[rid] = book

    def _entry(self, data: dict) -> _Entry:
        key = _key(data)
        if key not in self._shared:
            positions = data.get("positions")
            wanted = None if positions is None else torch.tensor(positions, dtype=torch.long)
            self._shared[key] = _Entry(edit_from_worker(data), wanted, data.get("after"), key,
                                       per_position=bool(data.get("per_position")))
        entry = self._shared[key]
        entry.holders += 1
        return entry

    def forget(self, rid: str) -> None:
        for chain in self.edits.pop(rid, {}).values():
            for entry in chain:
                entry.holders -= 1
                if not entry.holders and self._shared.get(entry.key) is entry:
                    del self._shared[entry.key]
                    self._local = {k: v for k, v in self._local.items() if k[0] != id(entry)}

    def addresses(self) -> set[Address]:
        return set().union(*(set(book) for book in self.edits.values())) if self.edits else set()

    def on_batch(self, spans: list[tuple[str, int, int]], positions: torch.Tensor) -> None:
        self.spans = [span for span in spans if span[0] in self.edits]
        self.positions = positions
        self._resid_pre = {}
        self._rows_of = {}

    # -- applying -------------------------------------------------------------------------------
    def edit(self, address: Address, tensor: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor`` (flat rows) with this forward's edits at ``address``: for each edited row
        ``edited(tensor + offset) - offset`` (``offset`` None: ``edited(tensor)``). A request's
        edits of one address apply in their order, stage by stage (its rows are its own, so the
        stages of different requests never meet). A new tensor when some row changes, else
        ``tensor`` itself."""
        chains = [(self.edits[rid].get(address, ()), start, end) for rid, start, end in self.spans]
        out = None
        for stage in range(max((len(chain) for chain, _, _ in chains), default=0)):
            groups: dict[int, tuple] = {}
            for chain, start, end in chains:
                if stage < len(chain):
                    groups.setdefault(id(chain[stage]), (chain[stage], []))[1].append((start, end))
            for entry, spans in groups.values():
                rows = self._rows(entry, tuple(spans))
                if rows is None:
                    continue
                now = tensor if out is None else out
                x = now[rows] if offset is None else now[rows] + offset[rows]
                block = self._block(address, x)
                edit = self._localized(entry, address)
                if entry.per_position:  # each row's own value: the block of its position
                    edit = _at_positions(edit, torch.searchsorted(entry.wanted, self.positions[rows]))
                new = apply_edit(edit, x.unflatten(-1, block)).flatten(-len(block))
                if offset is not None:
                    new = new - offset[rows]
                if out is None:
                    out = tensor.clone()
                out[rows] = new.to(out.dtype)
        return tensor if out is None else out

    def _rows(self, entry, spans: tuple):
        """The rows of ``spans`` (requests sharing ``entry``) that it edits: a slice or an index
        (None: none). Computed once per forward for each entry and set of requests."""
        key = (id(entry), spans)
        if key in self._rows_of:
            return self._rows_of[key]
        wanted, after = entry.wanted, entry.after
        if wanted is None and all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
            rows = slice(spans[0][0], spans[-1][1])  # adjacent requests: one view, no gather
        else:
            index = torch.cat([torch.arange(s, e) for s, e in spans])
            if wanted is not None:
                here = self.positions[index]
                hit = torch.isin(here, wanted)
                if after is not None:
                    hit |= here >= after
                index = index[hit]
            rows = index if len(index) else None
        self._rows_of[key] = rows
        return rows

    def _block(self, address: Address, x: torch.Tensor) -> tuple[int, ...]:
        """One position's block at ``address`` as this rank holds it."""
        if address.name in ("z", "q", "k", "v"):
            return (x.shape[-1] // self.info["d_head"], self.info["d_head"])
        return (x.shape[-1],)

    def _localized(self, entry, address: Address):
        """The edit as it applies to this rank's block of a sharded site (cached per entry)."""
        edit = entry.edit
        shard = self.table[address.name].shard
        if self.tp_size == 1 or not shard:
            return edit
        key = (id(entry), shard)
        if key not in self._local:
            self._local[key] = _localize(edit, address, shard, self.info, self.tp_rank, self.tp_size)
        return self._local[key]

    # -- resid_mid through attn_out_post ----------------------------------------------------------
    def keep_resid_pre(self, layer: int, parts: list[torch.Tensor]) -> None:
        self._resid_pre[layer] = parts[0] if len(parts) == 1 else parts[0] + parts[1]

    def resid_pre(self, layer: int) -> torch.Tensor:
        return self._resid_pre[layer]


def _at_positions(edit, columns: torch.Tensor):
    """``edit`` with its per-position vector / value cut to ``columns`` (one block per edited row)."""
    field = "vector" if isinstance(edit, Add) else "value"
    return dataclasses.replace(edit, **{field: getattr(edit, field)[columns]})


def _localize(edit, address: Address, shard: str, info: dict, rank: int, tp: int):
    """This rank's part of ``edit`` on a site sharded by heads / kv heads / columns."""
    if shard == "cols":
        width = info["d_mlp"] // tp
        lo, hi = rank * width, (rank + 1) * width
        cut = lambda t: t if t.dim() == 0 or t.shape[-1] == 1 else t[..., lo:hi]  # noqa: E731
    else:
        total = info["n_kv_heads"] if shard == "kv" else info["n_heads"]
        if shard == "kv" and total < tp:  # each kv head is replicated on tp / total ranks
            lo = rank // (tp // total)
            hi = lo + 1
        else:
            lo, hi = rank * total // tp, (rank + 1) * total // tp
        cut = lambda t: t if t.dim() < 2 or t.shape[-2] == 1 else t[..., lo:hi, :]  # noqa: E731
    changes = {}
    heads = getattr(edit, "heads", None)
    field = _TENSOR_FIELD.get(type(edit))
    if heads is not None and shard != "cols":
        changes["heads"] = tuple(h - lo for h in heads if lo <= h < hi) or _NO_HEADS
        if field is not None:
            changes[field] = getattr(edit, field)  # already the size of the edited heads
            if getattr(edit, field).dim() >= 2 and getattr(edit, field).shape[-2] == len(heads) > 1:
                keep = [i for i, h in enumerate(heads) if lo <= h < hi]
                changes[field] = getattr(edit, field)[..., keep, :] if keep else getattr(edit, field)[..., :0, :]
    elif isinstance(edit, DIRECTIONAL) and shard == "cols":
        # the projection on a direction sums over every column, and each rank holds only its own
        raise InternalError(f"[Internal] a directional edit on a column-sharded site reached rank {rank}: the "
                            f"model refuses it under tensor parallelism")
    elif field is not None:
        changes[field] = cut(getattr(edit, field))
    return dataclasses.replace(edit, **changes) if changes else edit


#: the field of each edit kind that holds a tensor cut with a sharded site
_TENSOR_FIELD = {Add: "vector", Set: "value", **{cls: "direction" for cls in DIRECTIONAL}}


#: an edit restricted to no head of this rank (its heads live on other ranks)
_NO_HEADS = ()
