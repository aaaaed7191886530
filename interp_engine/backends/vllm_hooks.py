"""Worker-side capture inside a vLLM model runner: hooks, and which rows belong to whom.

vLLM runs one *flat* batch per forward: the scheduled tokens of every running request,
concatenated without a batch dimension. Rows ``[query_start_loc[j], query_start_loc[j+1])``
belong to request ``j`` of the runner's persistent input batch, and the model's ``positions``
argument says which position of that request each row is (a prefill brings many rows, a
decode step one). A :class:`Recorder` reads that map in a pre-hook on the whole model, then
every site hook copies out the rows of the requests that asked for that site, keyed by
(request, position). A position computed twice (recompute after preemption) overwrites the
first copy. Nothing is ever sliced by ``seq_lens``.

Requests are *registered* with the points they want before they are first scheduled; only
registered requests are recorded, so warm-up, profiling and plain generation leave nothing.
Hooks exist only while some registered request needs them: an idle engine runs unhooked.

Under tensor parallelism every rank runs the same hooks in the same order (the logits are
gathered by a collective inside ``compute_logits``); sites that are identical on every rank are
kept on rank 0 only, sharded ones on every rank (the driver concatenates them).

Written against vLLM 0.32.0: it reads ``runner.model``, ``runner.input_batch.req_ids`` /
``num_reqs``, ``runner.query_start_loc.np`` and the model's ``compute_logits``.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch

from ..address import Address, parse_address
from ..archs import arch_for
from ..archs.vllm_sites import LOGITS, VllmRead, vllm_sites
from . import vllm_moe

#: (layer, module path, phase) -> the addresses read there
_Group = tuple[int, str, str]


class Recorder:
    """Records registered requests' rows at their requested sites, on one worker (one rank)."""

    def __init__(self, runner, tp_rank: int = 0):
        self.runner = runner
        self.model = runner.model
        self.tp_rank = tp_rank
        arch = arch_for(runner.model_config.hf_config)
        self.table = vllm_sites(arch.family)
        self.layers = self.model.get_submodule(arch.layers)
        self.wanted: dict[str, frozenset[Address]] = {}
        # request -> address -> [(forward positions, first row, chunk, offset, length)], in the
        # order computed; a chunk holds one forward's rows of every request that wanted it
        self.store: dict[str, dict[Address, list]] = {}
        # this forward's registered requests: (request, first row, end row), and its positions
        self.batch: list[tuple[str, int, int]] = []
        self._positions = torch.empty(0, dtype=torch.long)
        self._selections: dict[tuple, tuple] = {}
        self._uniform: tuple | None = None  # (points, selection) when all requests want the same
        self.max_batch = 0
        self._groups: dict[_Group, list[Address]] = {}
        self._handles: dict[object, object] = {}
        self._signatures: dict[int, inspect.Signature] = {}

    # -- registry -------------------------------------------------------------------------------
    def register(self, requests: dict[str, list[str]]) -> None:
        """``{request id: ["resid_post.3", ...]}``: record these rows from now on."""
        for rid, points in requests.items():
            self.wanted[rid] = frozenset(parse_address(p) for p in points)
            self.store[rid] = defaultdict(list)
        self._rehook()

    def take(self, request_ids: list[str]) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Pop what was recorded for ``request_ids``: ``{rid: {address: (rows, seen)}}`` where
        ``rows[p]`` is position ``p`` and ``seen[p]`` says whether it was computed (sites this
        rank does not keep are absent)."""
        out = {}
        for rid in request_ids:
            recorded = self.store.pop(rid, {})
            self.wanted.pop(rid, None)
            out[rid] = {str(a): _dense(chunks) for a, chunks in recorded.items()}
        self._rehook()
        return out

    def release(self, request_ids: list[str]) -> None:
        """Forget requests without returning their rows (aborted requests)."""
        for rid in request_ids:
            self.store.pop(rid, None)
            self.wanted.pop(rid, None)
        self._rehook()

    # -- hooks ----------------------------------------------------------------------------------
    def _keeps(self, address: Address) -> bool:
        """Rank 0 keeps every site; other ranks only the sharded ones."""
        if self.tp_rank == 0:
            return True
        return address.layer is not None and bool(self.table[address.name].shard)

    def _rehook(self) -> None:
        """Install the hooks the registered requests need, remove the rest."""
        addresses = set().union(*self.wanted.values()) if self.wanted else set()
        groups: dict[_Group, list[Address]] = defaultdict(list)
        for a in sorted(addresses):
            if a.layer is not None:
                read = self.table[a.name]
                groups[(a.layer, read.module, read.phase)].append(a)
        self._groups = dict(groups)
        needed: set[object] = set(groups)
        if addresses:
            needed.add("rows")
        if Address(LOGITS) in addresses:
            needed.add(LOGITS)
        for key in list(self._handles):
            if key not in needed:
                self._handles.pop(key).remove()
        for key in needed - set(self._handles):
            self._handles[key] = self._install(key)

    def _install(self, key):
        if key == "rows":
            return self.model.register_forward_pre_hook(self._on_batch, with_kwargs=True)
        if key == LOGITS:
            return self.model.register_forward_hook(self._on_final_hidden)
        layer, path, phase = key
        if phase == "call":
            return vllm_moe.wrap_call(self.layers[layer], path, self._output_hook(key))
        module = self.layers[layer].get_submodule(path) if path else self.layers[layer]
        if phase == "in":
            return module.register_forward_pre_hook(self._input_hook(key), with_kwargs=True)
        return module.register_forward_hook(self._output_hook(key))

    def _on_batch(self, module, args, kwargs):
        """Map this forward's rows to (request, position) for the registered requests."""
        self.batch = []
        self._selections = {}
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = self.runner.query_start_loc.np[: n + 1]
        for j, rid in enumerate(batch.req_ids[:n]):
            if rid in self.wanted:
                self.batch.append((rid, int(starts[j]), int(starts[j + 1])))
        self._uniform = None
        if self.batch:
            wants = {self.wanted[rid] for rid, _, _ in self.batch}
            if len(wants) == 1:  # the usual case: every request here wants the same points
                self._uniform = (wants.pop(), self._selection_of(tuple(self.batch)))
            positions = kwargs["positions"] if "positions" in kwargs else args[1]
            # on the host: the bookkeeping indexes with it (one small copy per forward on a GPU)
            self._positions = positions[: int(starts[n])].to("cpu", copy=True)
        self.max_batch = max(self.max_batch, len(self.batch))

    def _selection(self, address: Address):
        """The rows of this forward that requests want at ``address``: a selector (a slice when
        they are contiguous, else an index) and each request's (id, first row) in row order.
        Cached per set of requesters, so one forward selects once per distinct set."""
        if self._uniform is not None:
            wanted, selection = self._uniform
            return selection if address in wanted else None
        spans = tuple((rid, s, e) for rid, s, e in self.batch if address in self.wanted[rid])
        return self._selection_of(spans) if spans else None

    def _selection_of(self, spans: tuple):
        found = self._selections.get(spans)
        if found is None:
            if all(a[2] == b[1] for a, b in zip(spans, spans[1:])):
                selector = slice(spans[0][1], spans[-1][2])
            else:
                selector = torch.cat([torch.arange(s, e) for _, s, e in spans])
            found = self._selections[spans] = (selector, spans)
        return found

    def _input_hook(self, group: _Group):
        def hook(module, args, kwargs):
            if self.batch:
                bound = self._bind(module, args, kwargs)
                self._record(group, lambda read: [bound.get(name) for name in read.parts])

        return hook

    def _output_hook(self, group: _Group):
        def hook(module, args, output):
            if self.batch:
                items = output if isinstance(output, (tuple, list)) else (output,)
                self._record(group, lambda read: [items[i] for i in read.parts])

        return hook

    def _bind(self, module, args, kwargs) -> dict:
        signature = self._signatures.get(id(module))
        if signature is None:
            signature = self._signatures[id(module)] = inspect.signature(module.forward)
        return signature.bind_partial(*args, **kwargs).arguments

    def _record(self, group: _Group, operands) -> None:
        for address in self._groups.get(group, ()):
            if not self._keeps(address):
                continue
            selection = self._selection(address)
            if selection is None:
                continue
            read: VllmRead = self.table[address.name]
            parts = [p for p in operands(read) if p is not None]
            if read.layout == "s t d":  # streams first: this address's stream
                parts = [p[address.stream] for p in parts]
            self._keep(address, selection, _select(parts, selection[0]))

    def _keep(self, address: Address, selection, chunk: torch.Tensor) -> None:
        """One chunk per forward and address; each request keeps a reference to its rows."""
        offset = 0
        for rid, s, e in selection[1]:
            self.store[rid][address].append((self._positions, s, chunk, offset, e - s))
            offset += e - s

    def _on_final_hidden(self, module, args, hidden):
        """Logits at every recorded row, through the model's own ``compute_logits``.

        Every rank calls it (it gathers the vocabulary shards); rank 0 keeps the result."""
        logits = Address(LOGITS)
        selection = self._selection(logits) if self.batch else None
        if selection is None:
            return
        values = self.model.compute_logits(hidden[selection[0]])
        if values is not None and self.tp_rank == 0:
            self._keep(logits, selection, values)


def _select(parts: list[torch.Tensor], selector) -> torch.Tensor:
    """The selected rows of the sum of ``parts``, as a fresh tensor: vLLM's fused add-norms
    later write into their inputs in place."""
    pieces = [p[selector] for p in parts]
    if len(pieces) == 1:
        return pieces[0].clone() if isinstance(selector, slice) else pieces[0]
    total = pieces[0] + pieces[1]
    for piece in pieces[2:]:
        total += piece
    return total


def _dense(entries: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's rows in position order, from ``(positions, first row, chunk, offset, length)``
    entries in the order computed; a position computed again (recompute after preemption)
    takes the later value. Returns ``(rows, seen)``."""
    rows = torch.cat([chunk[o : o + n] for _, _, chunk, o, n in entries]).cpu()
    positions = torch.cat([pos[s : s + n] for pos, s, _, _, n in entries]).long()
    width = int(positions.max()) + 1
    if positions.numel() == width and torch.equal(positions, torch.arange(width)):
        return rows, torch.ones(width, dtype=torch.bool)
    out = torch.zeros((width, *rows.shape[1:]), dtype=rows.dtype)
    seen = torch.zeros(width, dtype=torch.bool)
    offset = 0
    for pos, s, _, _, n in entries:  # in order, so a recomputed position is overwritten
        out[pos[s : s + n].long()] = rows[offset : offset + n]
        seen[pos[s : s + n].long()] = True
        offset += n
    return out, seen
