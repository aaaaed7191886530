"""Where a worker keeps recorded rows until their request finishes, and how it hands them back.

One forward records, at each address, one *chunk*: the rows of every request that wanted the
address, side by side. The requests that wanted the same addresses in a forward form a
:class:`RowGroup`, which holds those chunks and where each request's rows sit in them; each request
keeps a list of the groups it was part of, in the order computed. Recording is therefore one
dictionary entry per (forward, address), however many requests share the forward.

When a request finishes, :meth:`RowStore.take` joins its rows. The chunks of a decode step (one
row per request) are stacked once per row shape (``[addresses, rows, ...]``, a few MiB a stack),
so a request's rows from all its decode steps are joined by one ``cat`` for many addresses
instead of one per address; a prefill's chunks are sliced per address (few pieces, most of the
bytes, copied once less). Every tensor handed back is a tensor of its own (never a view of rows
another address or request holds). A position computed twice (recompute after preemption)
keeps its later value.
"""

from __future__ import annotations

import torch

#: Stacks stay this small: a fresh allocation of hundreds of MiB costs more in page faults than
#: the copy itself, while small ones reuse memory the allocator already holds.
STACK_BYTES = 16 << 20


class RowGroup:
    """The rows that one forward recorded for one set of requests: ``chunks[address]`` holds
    every member's rows, member ``rid``'s at ``rows[rid] = (offset, count, positions)``."""

    __slots__ = ("chunks", "rows", "_stacks")

    def __init__(self, rows: dict[str, tuple[int, int, torch.Tensor]]):
        self.rows = rows
        self.chunks: dict = {}
        self._stacks: list | None = None

    def stacks(self) -> list[tuple[tuple, torch.Tensor]] | None:
        """``[(addresses, stacked chunks)]`` for a decode-like group (one row per member), chunks
        of one row shape and dtype stacked together, at most ``STACK_BYTES`` a stack; None for
        any other group (a prefill), whose chunks are sliced per address instead: a prefill has
        few groups, and its rows are the bulk of the data, copied once less so. Computed once,
        when the group's forward is over (the first member is taken)."""
        if self._stacks is None and len(self.rows) == sum(n for _, n, _ in self.rows.values()):
            kinds: dict[tuple, list] = {}
            for address, chunk in self.chunks.items():
                kinds.setdefault((chunk.shape[1:], chunk.dtype, chunk.device), []).append(address)
            self._stacks = []
            for addresses in kinds.values():
                per = max(1, STACK_BYTES // max(1, self.chunks[addresses[0]].nbytes))
                for i in range(0, len(addresses), per):
                    batch = tuple(addresses[i : i + per])
                    chunks = [self.chunks[a] for a in batch]
                    self._stacks.append((batch, chunks[0][None] if len(chunks) == 1 else torch.stack(chunks)))
            self.chunks = {}
        return self._stacks


class RowStore:
    """Each registered request's groups, in the order computed."""

    def __init__(self):
        self.groups: dict[str, list[RowGroup]] = {}

    def open(self, rid: str) -> None:
        self.groups[rid] = []

    def drop(self, rid: str) -> None:
        self.groups.pop(rid, None)

    def group(self, members: list[tuple[str, int, torch.Tensor]]) -> RowGroup:
        """A new group of ``(rid, count, positions)`` members, rows side by side in that order."""
        rows, offset = {}, 0
        for rid, count, positions in members:
            rows[rid] = (offset, count, positions)
            offset += count
        group = RowGroup(rows)
        for rid in rows:
            self.groups[rid].append(group)
        return group

    def take(self, rid: str) -> dict:
        """Pop ``rid``'s rows: ``{address: (rows, positions)}``, the rows in position order and
        ``positions`` the position of each, ascending and unique."""
        pieces: dict = {}  # address -> [(rows, positions)], in the order computed
        runs: list[tuple[tuple | None, list[RowGroup]]] = []  # consecutive decode groups laid out alike
        for group in self.groups.pop(rid, ()):
            stacks = group.stacks()
            layout = None if stacks is None else tuple(addresses for addresses, _ in stacks)
            if layout is not None and runs and runs[-1][0] == layout:
                runs[-1][1].append(group)
            else:
                runs.append((layout, [group]))
        for layout, groups in runs:
            spans = [group.rows[rid] for group in groups]
            if layout is None:  # one prefill-like group: its chunks, sliced
                offset, count, positions = spans[0]
                positions = positions.long()
                for address, chunk in groups[0].chunks.items():  # a lone request's chunk is its own
                    rows = chunk if count == len(chunk) else chunk[offset : offset + count]
                    pieces.setdefault(address, []).append((rows, positions))
                continue
            positions, keep = _latest(torch.cat([p for _, _, p in spans]).long())
            for k, addresses in enumerate(layout):
                joined = torch.cat([g.stacks()[k][1][:, o : o + n] for g, (o, n, _) in zip(groups, spans)], dim=1)
                joined = joined if keep is None else joined[:, keep]
                for address, rows in zip(addresses, joined.unbind(0)):
                    pieces.setdefault(address, []).append((rows, positions))
        orders: dict[tuple, tuple] = {}  # addresses recorded in the same forwards share one order
        return {address: _join(parts, orders) for address, parts in pieces.items()}


def _latest(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(positions ascending and unique, index of the row kept for each)``; the index is None
    when they already are. A position computed again takes its later value."""
    if positions.numel() < 2 or bool((positions[1:] > positions[:-1]).all()):
        return positions, None
    order = torch.sort(positions, stable=True).indices  # equal positions stay in computed order
    ordered = positions[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]  # the latest computation of each position
    return ordered[last], order[last]


def _join(parts: list[tuple[torch.Tensor, torch.Tensor]], orders: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One address's rows from its pieces in the order computed, on the host, as a tensor of its
    own (never a view of rows another address or request also holds). ``orders`` caches the
    position order by the pieces' position tensors."""
    if len(parts) == 1:
        rows, positions = parts[0]
        return rows.to("cpu", copy=rows._base is not None), positions
    key = tuple(id(p) for _, p in parts)
    if key not in orders:
        orders[key] = _latest(torch.cat([p for _, p in parts]))
    positions, keep = orders[key]
    rows = torch.cat([r for r, _ in parts])
    return (rows if keep is None else rows[keep]).cpu(), positions
