"""Where a worker keeps recorded rows until their request finishes, and how it hands them back.

One forward records, at each address, one *chunk*: the rows of every request that wanted the
address, side by side. The requests that wanted the same addresses in a forward form a
:class:`Group`, which holds those chunks and where each request's rows sit in them; each request
keeps a list of the groups it was part of, in the order computed. Recording is therefore one
dictionary entry per (forward, address), however many requests share the forward.

When a request finishes, :meth:`RowStore.take` joins its rows. Chunks of one group with the same
row shape are stacked once (``[addresses, rows, ...]``), so a request's rows at every address are
joined by one ``cat`` over its groups instead of one per address, then split into independent
tensors (nothing handed back shares storage with another address or request). A position
computed twice (recompute after preemption) keeps its later value.
"""

from __future__ import annotations

import torch


class Group:
    """The rows that one forward recorded for one set of requests: ``chunks[address]`` holds
    every member's rows, member ``rid``'s at ``rows[rid] = (offset, count, positions)``."""

    __slots__ = ("chunks", "rows", "_stacks")

    def __init__(self, rows: dict[str, tuple[int, int, torch.Tensor]]):
        self.rows = rows
        self.chunks: dict = {}
        self._stacks: list | None = None

    def stacks(self) -> list[tuple[tuple, torch.Tensor]]:
        """``[(addresses, stacked chunks)]``, one per row shape and dtype; computed once, when
        the group's forward is over (the first member is taken)."""
        if self._stacks is None:
            kinds: dict[tuple, list] = {}
            for address, chunk in self.chunks.items():
                kinds.setdefault((chunk.shape[1:], chunk.dtype, chunk.device), []).append(address)
            self._stacks = [(tuple(addresses), torch.stack([self.chunks[a] for a in addresses]))
                            for addresses in kinds.values()]
            self.chunks = {}
        return self._stacks


class RowStore:
    """Each registered request's groups, in the order computed."""

    def __init__(self):
        self.groups: dict[str, list[Group]] = {}

    def open(self, rid: str) -> None:
        self.groups[rid] = []

    def drop(self, rid: str) -> None:
        self.groups.pop(rid, None)

    def group(self, members: list[tuple[str, int, torch.Tensor]]) -> Group:
        """A new group of ``(rid, count, positions)`` members, rows side by side in that order."""
        rows, offset = {}, 0
        for rid, count, positions in members:
            rows[rid] = (offset, count, positions)
            offset += count
        group = Group(rows)
        for rid in rows:
            self.groups[rid].append(group)
        return group

    def take(self, rid: str) -> dict:
        """Pop ``rid``'s rows: ``{address: (rows, positions)}``, the rows in position order and
        ``positions`` the position of each, ascending and unique."""
        pieces: dict = {}  # address -> [(rows, positions)], one per run, in the order computed
        runs: list[tuple[tuple, list[Group]]] = []  # consecutive groups laid out alike
        for group in self.groups.pop(rid, ()):
            layout = tuple(addresses for addresses, _ in group.stacks())
            if runs and runs[-1][0] == layout:
                runs[-1][1].append(group)
            else:
                runs.append((layout, [group]))
        for layout, groups in runs:
            spans = [group.rows[rid] for group in groups]
            positions, keep = _latest(torch.cat([p for _, _, p in spans]).long())
            for k, addresses in enumerate(layout):
                joined = torch.cat([g.stacks()[k][1][:, o : o + n] for g, (o, n, _) in zip(groups, spans)], dim=1)
                joined = joined.cpu() if keep is None else joined[:, keep].cpu()
                for address, rows in zip(addresses, joined.unbind(0)):
                    pieces.setdefault(address, []).append((rows, positions))
        return {address: _join(parts) for address, parts in pieces.items()}


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


def _join(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One address's rows from its runs in the order computed, as a tensor of its own (not a view
    of the other addresses' rows)."""
    if len(parts) == 1:
        rows, positions = parts[0]
        return rows.clone(), positions
    positions, keep = _latest(torch.cat([p for _, p in parts]))
    rows = torch.cat([r for r, _ in parts])
    return (rows if keep is None else rows[keep]), positions
