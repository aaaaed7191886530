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
A request registered with a position selection (``positions=`` of the capture call) keeps only
those rows: the others are dropped here, in the worker, before any copy is made.
Hooks exist only while some registered request needs them: an idle engine runs unhooked.
A request may also carry edits (:mod:`.vllm_edits`): the same hooks apply them to that request's
rows first, then record, so a capture of an edited site reads the edited value.

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

from ..address import SITES, Address, parse_address
from ..archs import arch_for, model_info
from ..archs.vllm_sites import LOGITS, VllmRead, vllm_sites
from . import vllm_moe
from .vllm_edits import EditBook
from .vllm_rows import RowStore

#: (layer, module path, phase) -> the addresses read there
_Group = tuple[int, str, str]


class Recorder:
    """Records registered requests' rows at their requested sites, on one worker (one rank)."""

    def __init__(self, runner, tp_rank: int = 0, tp_size: int = 1):
        self.runner = runner
        self.model = runner.model
        self.tp_rank = tp_rank
        arch = arch_for(runner.model_config.hf_config)
        self.table = vllm_sites(arch.family)
        info = model_info(runner.model_config.hf_config, "")
        self.editor = EditBook(self.table, {"n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads,
                                            "d_head": info.d_head, "d_mlp": info.d_mlp}, tp_rank, tp_size)
        # hook -> the edits applied there, in forward order; hook -> layer whose resid_pre it keeps
        self._edit_groups: dict[_Group, list[Address]] = {}
        self._stash_groups: dict[_Group, int] = {}
        self.layers = self.model.get_submodule(arch.layers)
        self.wanted: dict[str, frozenset[Address]] = {}
        self._sets: dict[frozenset, frozenset] = {}
        # request -> (prompt positions kept, first generated position kept or None)
        self.filters: dict[str, tuple[torch.Tensor, int | None]] = {}
        #: each registered request's recorded rows (one chunk per forward and address, shared)
        self.rows = RowStore()
        # this forward's registered requests: (request, first row, end row, kept rows or None = all,
        # the positions of the kept rows)
        self.batch: list[tuple[str, int, int, torch.Tensor | None, torch.Tensor]] = []
        #: bytes of every row this worker has handed back (what crosses to the driver)
        self.bytes_returned = 0
        self._positions = torch.empty(0, dtype=torch.long)
        self._selections: dict[tuple, tuple] = {}
        self._uniform: tuple | None = None  # (points, selection) when all requests want the same
        self.max_batch = 0
        self._groups: dict[_Group, list[Address]] = {}
        self._handles: dict[object, object] = {}
        self._signatures: dict[int, inspect.Signature] = {}

    # -- registry -------------------------------------------------------------------------------
    def register(self, requests: dict[str, list[str] | dict]) -> None:
        """``{request id: ["resid_post.3", ...]}`` or ``{request id: {"points": [...], "positions":
        [0, 5], "after": 6}}`` (keep prompt positions 0 and 5 and every position from 6 on):
        record these rows from now on."""
        for rid, want in requests.items():
            points = want["points"] if isinstance(want, dict) else want
            wanted = frozenset(parse_address(p) for p in points)
            # one object per distinct set: forwards compare the sets of their requests by identity
            self.wanted[rid] = self._sets.setdefault(wanted, wanted)
            self.rows.open(rid)
            if isinstance(want, dict) and want.get("positions") is not None:
                self.filters[rid] = (torch.tensor(want["positions"], dtype=torch.long), want.get("after"))
            if isinstance(want, dict) and want.get("edits"):
                self.editor.register(rid, want["edits"])
        self._rehook()

    def take(self, request_ids: list[str]) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Pop what was recorded for ``request_ids``: ``{rid: {address: (rows, positions)}}``, the
        rows in position order, ``positions`` the position of each (sites this rank does not keep
        are absent)."""
        out = {}
        for rid in request_ids:
            out[rid] = {str(a): rows for a, rows in self.rows.take(rid).items()}
            self.wanted.pop(rid, None)
            self.filters.pop(rid, None)
            self.editor.forget(rid)
            self.bytes_returned += sum(r.nbytes + p.nbytes for r, p in out[rid].values())
        if not self.wanted:
            self._sets.clear()
        self._rehook()
        return out

    def release(self, request_ids: list[str]) -> None:
        """Forget requests without returning their rows (aborted requests)."""
        for rid in request_ids:
            self.rows.drop(rid)
            self.wanted.pop(rid, None)
            self.filters.pop(rid, None)
            self.editor.forget(rid)
        if not self.wanted:
            self._sets.clear()
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
        edits: dict[_Group, list[Address]] = defaultdict(list)
        self._stash_groups = {}
        for a in sorted(self.editor.addresses(), key=lambda a: (a.layer, list(SITES).index(a.name))):
            read = self._write_read(a)
            edits[(a.layer, read.module, read.phase)].append(a)
            if a.name == "resid_mid":
                pre = self.table["resid_pre"]
                self._stash_groups[(a.layer, pre.module, pre.phase)] = a.layer
        self._edit_groups = dict(edits)
        needed: set[object] = set(groups) | set(edits) | set(self._stash_groups)
        if addresses or edits:
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
        every = [(rid, int(starts[j]), int(starts[j + 1])) for j, rid in enumerate(batch.req_ids[:n])]
        spans = [span for span in every if span[0] in self.wanted]
        self._uniform = None
        if spans:
            positions = kwargs["positions"] if "positions" in kwargs else args[1]
            # on the host: the bookkeeping indexes with it (one small copy per forward on a GPU)
            self._positions = positions[: int(starts[n])].to("cpu", copy=True)
        self.editor.on_batch(every if self.editor.edits else [], self._positions)
        for rid, s, e in spans:
            kept, here = None, self._positions[s:e]
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

    def _selection(self, address: Address):
        """The rows of this forward that requests want at ``address``: a selector (a slice when
        they are contiguous, else an index) and the :class:`~.vllm_rows.Group` of those requests
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

    def _write_read(self, address: Address) -> VllmRead:
        """Where an edit of ``address`` is written: its own read, except resid_mid (through attn_out)."""
        return self.table["attn_out" if address.name == "resid_mid" else address.name]

    def _apply(self, group: _Group, values: dict) -> bool:
        """Apply this forward's edits at ``group`` to ``values`` (part name or index -> tensor),
        in place in the dict; True when something changed."""
        changed = False
        for a in self._edit_groups.get(group, ()) if self.editor.spans else ():
            names = [p for p in self._write_read(a).parts if values.get(p) is not None]
            last = names[-1]
            if a.name == "resid_mid":
                offset = self.editor.resid_pre(a.layer)
            else:
                others = [values[p] for p in names[:-1]]
                offset = others[0] if len(others) == 1 else (sum(others) if others else None)
            new = self.editor.edit(a, values[last], offset)
            if new is not values[last]:
                values[last], changed = new, True
        if group in self._stash_groups and self.editor.spans:
            parts = [values[p] for p in self.table["resid_pre"].parts if values.get(p) is not None]
            self.editor.keep_resid_pre(self._stash_groups[group], parts)
        return changed

    def _input_hook(self, group: _Group):
        def hook(module, args, kwargs):
            editing = self.editor.spans and (group in self._edit_groups or group in self._stash_groups)
            if not (self.batch or editing):
                return None
            bound = dict(self._bind(module, args, kwargs))
            changed = self._apply(group, bound) if editing else False
            if self.batch:
                self._record(group, lambda read: [bound.get(name) for name in read.parts])
            return self._rebind(module, args, kwargs, bound) if changed else None

        return hook

    def _output_hook(self, group: _Group):
        def hook(module, args, output):
            editing = self.editor.spans and group in self._edit_groups
            if not (self.batch or editing):
                return None
            many = isinstance(output, (tuple, list))
            items = dict(enumerate(output if many else (output,)))
            changed = self._apply(group, items) if editing else False
            if self.batch:
                self._record(group, lambda read: [items[i] for i in read.parts])
            if not changed:
                return None
            values = [items[i] for i in range(len(items))]
            return type(output)(values) if many else values[0]

        return hook

    def _rebind(self, module, args, kwargs, bound: dict):
        """``(args, kwargs)`` with the edited arguments of ``bound`` put back where they came from."""
        names = list(self._signatures[id(module)].parameters)
        args, kwargs = list(args), dict(kwargs)
        for name, value in bound.items():
            if name in kwargs:
                kwargs[name] = value
            elif names.index(name) < len(args):
                args[names.index(name)] = value
        return tuple(args), kwargs

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
        """One chunk per forward and address, held by the group of requests that wanted it."""
        selection[1].chunks[address] = chunk

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

