"""Sparse dictionaries inside a vLLM worker: each request's features encoded from its own rows of
the flat batch, in the hook that produces them; only the active features leave the worker.

A dictionary reaches the worker once (``interp_add_dictionary``: its tensors, kept on the
worker's device under its content key, until ``interp_drop_dictionary``); a request names the dictionaries it uses and what it
asks of each (:func:`interp_engine.features.transfer.features_for_worker`). In each forward, at each site a
registered request's dictionary reads or writes, the request's rows ``[s, e)`` (contiguous
positions from ``positions[s]``: a prefill or a decode step) run through the same per-dictionary
step as on the eager backend (:class:`interp_engine.features.run.DictionaryStep`): features
encoded, feature and error edits applied with the error term kept, records handed to this book.
A request's rows change only where its own edits say; requests without feature work that share
the batch run exactly as they would alone.

Records are kept per request until it finishes: a dictionary's features as compressed rows of
its active entries (:class:`~interp_engine.features.sparse.SparseRows`), subsets and error terms
as dense rows, each with the positions it holds (a position computed twice keeps its later
value), restricted to the positions the request keeps (``positions=``).

Under tensor parallelism the sites a dictionary may sit at on this backend are replicated on
every rank; every rank runs the same steps (so edits stay identical across ranks) and rank 0
keeps the records.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from interp_engine.address import Address, FeatureAddress
from interp_engine.features.plan import Attached, sparse_point
from interp_engine.features.run import DictionaryStep, steps_at
from interp_engine.features.sparse import SparseRows
from interp_engine.features.transfer import dictionary_from_worker, features_from_worker
from interp_engine.wire import WorkerRequest


class FeatureBook:
    """The dictionaries on one worker, the registered requests' work with them, and the records."""

    def __init__(self, device, tp_rank: int = 0):
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.dictionaries: dict[str, object] = {}
        # request -> site -> [(step, phase)], in the order they run at that site
        self.work: dict[str, dict[Address, list]] = {}
        self.filters: dict[str, tuple[torch.Tensor | None, int | None]] = {}
        # request -> point -> [(positions, payload)] in the order computed
        self.records: dict[str, dict[FeatureAddress, list]] = {}
        self.spans: list[tuple[str, int, int]] = []
        self.positions = torch.empty(0, dtype=torch.long)
        #: bytes of every record handed back (what crosses to the driver)
        self.bytes_returned = 0

    def add_dictionary(self, data: dict) -> None:
        if data["key"] not in self.dictionaries:
            self.dictionaries[data["key"]] = dictionary_from_worker(data).to(self.device)

    def drop_dictionary(self, key: str) -> None:
        """Forget the dictionary kept under ``key`` (requests registered with it keep their steps'
        reference until they finish)."""
        self.dictionaries.pop(key, None)

    def dictionary_bytes(self) -> int:
        """Bytes of the dictionaries' tensors kept here."""
        tensors = [getattr(d, f.name) for d in self.dictionaries.values() for f in dataclasses.fields(d)]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def register(self, rid: str, request: WorkerRequest) -> None:
        if not request.features:
            return
        attached: list[Attached] = features_from_worker(request.features, self.dictionaries)
        self.work[rid] = steps_at([DictionaryStep(a, a.dictionary, self.device) for a in attached])
        self.records[rid] = defaultdict(list)
        positions = None if request.positions is None else torch.tensor(request.positions, dtype=torch.long)
        self.filters[rid] = (positions, request.after)

    def forget(self, rid: str) -> None:
        self.work.pop(rid, None)
        self.records.pop(rid, None)
        self.filters.pop(rid, None)

    def addresses(self) -> set[Address]:
        """The sites some registered request's dictionaries read or write."""
        return set().union(*(set(sites) for sites in self.work.values())) if self.work else set()

    def on_batch(self, spans: list[tuple[str, int, int]], positions: torch.Tensor) -> None:
        self.spans = [span for span in spans if span[0] in self.work]
        self.positions = positions

    def apply(self, address: Address, tensor: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor`` (flat rows; the site is ``tensor + offset`` where vLLM holds it as a sum) after
        the dictionaries that work at ``address``, request by request: a new tensor when a row
        changes, else ``tensor`` itself (written back as ``edited - offset``)."""
        out = None
        for rid, start, end in self.spans:
            steps = self.work[rid].get(address)
            if not steps:
                continue
            x = tensor[start:end] if offset is None else tensor[start:end] + offset[start:end]
            first = int(self.positions[start])
            sink = self._sink(rid, self.positions[start:end])
            new = x[None]
            for step, phase in steps:
                new = step.step(phase, new, first, sink)
            if new[0] is not x:
                if out is None:
                    out = tensor.clone()
                out[start:end] = (new[0] if offset is None else new[0] - offset[start:end]).to(out.dtype)
        return tensor if out is None else out

    def _sink(self, rid: str, positions: torch.Tensor):
        """Where request ``rid``'s records of this forward go: its kept positions only, sparse
        where the point is a dictionary's whole feature vector (rank 0 keeps them)."""
        wanted, after = self.filters[rid]
        keep = None
        if wanted is not None:
            hit = torch.isin(positions, wanted)
            if after is not None:
                hit |= positions >= after
            keep = hit.nonzero().flatten()
        records = self.records[rid]

        def sink(point: FeatureAddress, value: torch.Tensor) -> None:
            if self.tp_rank != 0:
                return
            rows, at = value[0], positions
            if keep is not None:
                if not len(keep):
                    return
                rows, at = rows[keep.to(rows.device)], positions[keep]
            payload = SparseRows.of(rows).cpu() if sparse_point(point) else rows.detach().to("cpu", copy=True)
            records[point].append((at.clone(), payload))

        return sink

    def take(self, rid: str) -> dict[str, dict]:
        """Pop ``rid``'s records: per point, ``{"positions", "offsets", "ids", "values"}`` (sparse)
        or ``{"positions", "rows"}``, positions ascending, each once (the later computation)."""
        out = {}
        for point, pieces in self.records.pop(rid, {}).items():
            positions = torch.cat([p for p, _ in pieces])
            order = torch.sort(positions, stable=True).indices
            ordered = positions[order]
            last = torch.ones_like(ordered, dtype=torch.bool)
            last[:-1] = ordered[1:] != ordered[:-1]
            order, ordered = order[last], ordered[last]
            if isinstance(pieces[0][1], SparseRows):
                joined = _join_sparse([s for _, s in pieces])
                chosen = _pick_sparse(joined, order)
                item = {"offsets": chosen.offsets, "ids": chosen.ids, "values": chosen.values, "width": chosen.width}
            else:
                item = {"rows": torch.cat([r for _, r in pieces])[order]}
            item["positions"] = ordered
            self.bytes_returned += sum(t.nbytes for t in item.values() if isinstance(t, torch.Tensor))
            out[str(point)] = item
        self.forget(rid)
        return out


def _join_sparse(parts: list[SparseRows]) -> SparseRows:
    if len(parts) == 1:
        return parts[0]
    offsets = [parts[0].offsets]
    for part in parts[1:]:
        offsets.append(part.offsets[1:] + offsets[-1][-1])
    return SparseRows(torch.cat(offsets), torch.cat([p.ids for p in parts]), torch.cat([p.values for p in parts]),
                      parts[0].width)


def _pick_sparse(rows: SparseRows, order: torch.Tensor) -> SparseRows:
    """Rows ``order`` of ``rows``, in that order."""
    if order.numel() == rows.n and bool((order == torch.arange(rows.n)).all()):
        return rows
    counts = rows.offsets.diff()[order]
    starts = rows.offsets[:-1][order]
    index = torch.cat([torch.arange(int(s), int(s) + int(c)) for s, c in zip(starts, counts)]) if len(order) else \
        torch.zeros(0, dtype=torch.long)
    offsets = torch.zeros(len(order) + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return SparseRows(offsets, rows.ids[index], rows.values[index], rows.width)
