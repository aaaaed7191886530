"""Which rows of vLLM's flat batch belong to which registered request.

vLLM runs one *flat* batch per forward: the scheduled tokens of every running request,
concatenated without a batch dimension. Rows ``[starts[j], starts[j + 1])`` belong to request
``j`` of the runner's persistent input batch, and the model's ``positions`` argument says which
position of that request each row is (a prefill brings many rows, a decode step one). A
:class:`BatchRows` reads that map once per forward (:func:`.vllm_compat.batch_map`); every site
hook then asks it which rows to copy for an address, keyed by (request, position). Nothing is
ever sliced by ``seq_lens``, and nothing assumes a request's rows start at position 0: a prompt
prefilled in chunks, or whose first forward starts after a prefix-cache hit (:mod:`..prefix`),
files each forward's rows at the positions they are.

Only registered requests are recorded, so warm-up, profiling and plain generation leave
nothing. A request registered with a position selection keeps only those rows: the others are
dropped here, before any copy is made.
"""

from __future__ import annotations

import torch

from interp_engine.address import Address, parse_address
from .rows import RowStore
from interp_engine.wire import WorkerRequest


class BatchRows:
    """The registered requests of one worker, and this forward's rows of each."""

    def __init__(self):
        self.wanted: dict[str, frozenset[Address]] = {}
        self._sets: dict[frozenset, frozenset] = {}
        # request -> (prompt positions kept, first generated position kept or None)
        self.filters: dict[str, tuple[torch.Tensor, int | None]] = {}
        #: each registered request's recorded rows (one chunk per forward and address, shared)
        self.rows = RowStore()
        # this forward's registered requests: (request, first row, end row, kept rows or None = all,
        # the positions of the kept rows)
        self.batch: list[tuple[str, int, int, torch.Tensor | None, torch.Tensor]] = []
        #: every request of this forward, registered or not: (request, first row, end row)
        self.every: list[tuple[str, int, int]] = []
        self.positions = torch.empty(0, dtype=torch.long)
        self._selections: dict[tuple, tuple] = {}
        self._uniform: tuple | None = None  # (points, selection) when all requests want the same
        #: the most registered requests seen in one forward
        self.max_batch = 0

    def addresses(self) -> set[Address]:
        return set().union(*self.wanted.values()) if self.wanted else set()

    def register(self, rid: str, request: WorkerRequest) -> None:
        wanted = frozenset(parse_address(p) for p in request.points)
        # one object per distinct set: forwards compare the sets of their requests by identity
        self.wanted[rid] = self._sets.setdefault(wanted, wanted)
        self.rows.open(rid)
        if request.positions is not None:
            self.filters[rid] = (torch.tensor(request.positions, dtype=torch.long), request.after)

    def forget(self, rid: str) -> None:
        self.wanted.pop(rid, None)
        self.filters.pop(rid, None)
        if not self.wanted:
            self._sets.clear()

    def on_batch(self, req_ids: list[str], starts: list[int], positions) -> None:
        """Map this forward's rows (``req_ids`` / ``starts`` of the runner, the model's
        ``positions`` argument) to (request, position) for the registered requests."""
        self.batch = []
        self._selections = {}
        n = len(req_ids)
        self.every = [(rid, starts[j], starts[j + 1]) for j, rid in enumerate(req_ids)]
        spans = [span for span in self.every if span[0] in self.wanted]
        self._uniform = None
        if spans:
            # on the host: the bookkeeping indexes with it (one small copy per forward on a GPU)
            self.positions = positions[: starts[n]].to("cpu", copy=True)
        for rid, s, e in spans:
            kept, here = None, self.positions[s:e]
            if rid in self.filters:
                wanted, after = self.filters[rid]
                hit = torch.isin(here, wanted)
                if after is not None:
                    hit |= here >= after
                local = hit.nonzero().flatten()
                if not len(local):
                    continue  # nothing of this request's forward is selected: nothing is copied
                if len(local) < e - s:
                    kept, here = s + local, here[local]
            self.batch.append((rid, s, e, kept, here))
        if self.batch:
            wants = {self.wanted[rid] for rid, *_ in self.batch}
            if len(wants) == 1:  # the usual case: every request here wants the same points
                self._uniform = (wants.pop(), self._selection_of(tuple(self.batch)))
        self.max_batch = max(self.max_batch, len(self.batch))

    def selection(self, address: Address):
        """The rows of this forward that requests want at ``address``: a selector (a slice when
        they are contiguous, else an index) and the :class:`~.rows.RowGroup` of those requests
        that keeps them. Cached per set of requesters, so one forward selects once per distinct set."""
        if self._uniform is not None:
            wanted, selection = self._uniform
            return selection if address in wanted else None
        spans = tuple(span for span in self.batch if address in self.wanted[span[0]])
        return self._selection_of(spans) if spans else None

    def _selection_of(self, spans: tuple):
        key = tuple(span[0] for span in spans)
        found = self._selections.get(key)
        if found is None:
            whole = all(span[3] is None for span in spans)
            if whole and all(a[2] == b[1] for a, b in zip(spans, spans[1:])):
                selector = slice(spans[0][1], spans[-1][2])
            else:
                selector = torch.cat([torch.arange(s, e) if kept is None else kept for _, s, e, kept, _ in spans])
            group = self.rows.group([(rid, len(positions), positions) for rid, _, _, _, positions in spans])
            found = self._selections[key] = (selector, group)
        return found

    @staticmethod
    def keep(address: Address, selection, chunk: torch.Tensor) -> None:
        """One chunk per forward and address, held by the group of requests that wanted it."""
        selection[1].chunks[address] = chunk
