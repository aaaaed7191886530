"""Worker-side capture inside a vLLM model runner: the hooks.

A :class:`WorkerRecorder` reads this forward's flat-batch map in a pre-hook on the whole model
(:mod:`.batch`: which rows belong to which registered request), then every site hook copies
out the rows of the requests that asked for that site, keyed by (request, position). A position
computed twice (recompute after preemption) overwrites the first copy.

Requests are *registered* with the points they want before they are first scheduled; only
registered requests are recorded. Hooks exist only while some registered request needs them:
an idle engine runs unhooked. A request may also carry edits (:mod:`.edits`): the same
hooks apply them to that request's rows first, then record, so a capture of an edited site
reads the edited value.

Under tensor parallelism every rank runs the same hooks in the same order (the logits are
gathered by a collective inside the model's logits computation); sites that are identical on
every rank are kept on rank 0 only, sharded ones on every rank (the driver concatenates them).
vLLM's private structure is reached through :mod:`..compat` only.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch

from interp_engine.address import SITES, Address
from interp_engine.archs import LOGITS, ONE, Group, Hook, arch_for, group_sites, model_info, vllm_sites
from interp_engine.archs.base import layer_module
from .. import compat as vllm_compat
from . import experts as vllm_moe
from .batch import BatchRows
from .edits import EditBook
from .features import FeatureBook
from interp_engine.wire import WorkerRequest


FINAL_NORM = Address("final_norm")


class WorkerRecorder:
    """Records registered requests' rows at their requested sites, on one worker (one rank)."""

    def __init__(self, runner, tp_rank: int = 0, tp_size: int = 1):
        self.runner = runner
        self.model = vllm_compat.runner_model(runner)
        self.tp_rank = tp_rank
        config = vllm_compat.runner_hf_config(runner)
        arch = arch_for(config)
        self.table = vllm_sites(arch.family)
        #: (module, phase) of the reads that see the flat batch inside a batch axis of one
        self._one = {(read.module, read.phase) for read in self.table.values() if read.layout == ONE}
        info = model_info(config, "")
        self.editor = EditBook(self.table, {"n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads,
                                            "d_head": info.d_head, "d_mlp": info.d_mlp}, tp_rank, tp_size)
        # hook -> the edits applied there, in forward order; hook -> layer whose resid_pre it keeps
        self._edit_groups: dict[Group, list[Address]] = {}
        self._stash_groups: dict[Group, int] = {}
        #: the registered requests' sparse dictionaries (:mod:`.features`), run like edits at their sites
        self.features = FeatureBook(next(self.model.parameters()).device, tp_rank)
        layers = arch.vllm_path("layers")
        self.layers = self.model.get_submodule(layers)
        #: the module that runs the layers (its forward loops over them)
        self.stack = self.model.get_submodule(layers.rpartition(".")[0])
        #: the registered requests and this forward's rows of each
        self.requests = BatchRows()
        #: bytes of every row this worker has handed back (what crosses to the driver)
        self.bytes_returned = 0
        self._groups: dict[Group, list[Address]] = {}
        self._handles: dict[object, object] = {}
        self._signatures: dict[int, inspect.Signature] = {}

    @property
    def hooks_installed(self) -> int:
        """How many hooks are installed now (an idle engine has none)."""
        return len(self._handles)

    @property
    def batch(self) -> list:
        return self.requests.batch

    # -- registry -------------------------------------------------------------------------------
    def register(self, requests: dict[str, WorkerRequest]) -> None:
        """``{request id: WorkerRequest}``: record (and edit) these requests' rows from now on
        (only the positions a request keeps, when it names some)."""
        for rid, request in requests.items():
            self.requests.register(rid, request)
            if request.edits:
                self.editor.register(rid, request.edits)
            self.features.register(rid, request)
        self._rehook()

    def take(self, request_ids: list[str]) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Pop what was recorded for ``request_ids``: ``{rid: {address: (rows, positions)}}``, the
        rows in position order, ``positions`` the position of each (sites this rank does not keep
        are absent)."""
        out = {}
        for rid in request_ids:
            out[rid] = {str(a): rows for a, rows in self.requests.rows.take(rid).items()}
            self.requests.forget(rid)
            self.editor.forget(rid)
            self.bytes_returned += sum(r.nbytes + p.nbytes for r, p in out[rid].values())
            out[rid].update(self.features.take(rid))
        self._rehook()
        return out

    def release(self, request_ids: list[str]) -> None:
        """Forget requests without returning their rows (aborted requests)."""
        for rid in request_ids:
            self.requests.rows.drop(rid)
            self.requests.forget(rid)
            self.editor.forget(rid)
            self.features.forget(rid)
        self._rehook()

    # -- hooks ----------------------------------------------------------------------------------
    def _keeps(self, address: Address) -> bool:
        """Rank 0 keeps every site; other ranks only the sharded ones."""
        if self.tp_rank == 0:
            return True
        return address.layer is not None and bool(self.table[address.name].shard)

    def _rehook(self) -> None:
        """Install the hooks the registered requests need, remove the rest."""
        addresses = self.requests.addresses()
        groups = group_sites(sorted(addresses), self.table)
        self._groups = groups
        edits: dict[Group, list[Address]] = defaultdict(list)
        self._stash_groups = {}
        written = self.editor.addresses() | self.features.addresses()
        for a in sorted(written, key=lambda a: (a.layer, list(SITES).index(a.name))):
            read = self._write_read(a)
            edits[(a.layer, read.module, read.phase)].append(a)
            if a.name == "resid_mid":
                pre = self.table["resid_pre"]
                self._stash_groups[(a.layer, pre.module, pre.phase)] = a.layer
        self._edit_groups = dict(edits)
        needed: set[object] = set(groups) | set(edits) | set(self._stash_groups)
        if addresses or edits:
            needed.add("rows")
        if Address(LOGITS) in addresses or FINAL_NORM in addresses:
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
        if phase == "select":
            return vllm_moe.wrap_selection(self.layers[layer], path, self._output_hook(key))
        module = layer_module(self.layers[layer], path)
        if phase == "in":
            return module.register_forward_pre_hook(self._input_hook(key), with_kwargs=True)
        return module.register_forward_hook(self._output_hook(key))

    def _on_batch(self, module, args, kwargs):
        """Map this forward's rows to (request, position) for the registered requests."""
        req_ids, starts = vllm_compat.batch_map(self.runner)
        self.requests.on_batch(req_ids, starts, vllm_compat.forward_positions(args, kwargs))
        self.editor.on_batch(self.requests.every if self.editor.edits else [], self.requests.positions)
        self.features.on_batch(self.requests.every if self.features.work else [], self.requests.positions)

    @property
    def _editing(self) -> bool:
        """Whether some request of this forward edits, or runs a dictionary."""
        return bool(self.editor.spans or self.features.spans)

    def _write_read(self, address: Address) -> Hook:
        """Where an edit of ``address`` is written: its own read, except resid_mid (through attn_out_post)."""
        return self.table["attn_out_post" if address.name == "resid_mid" else address.name]

    def _apply(self, group: Group, values: dict) -> bool:
        """Apply this forward's edits at ``group`` to ``values`` (part name or index -> tensor),
        in place in the dict; True when something changed."""
        changed = False
        for a in self._edit_groups.get(group, ()) if self._editing else ():
            names = [p for p in self._write_read(a).parts if values.get(p) is not None]
            last = names[-1]
            if a.name == "resid_mid":
                offset = self.editor.resid_pre(a.layer)
            else:
                others = [values[p] for p in names[:-1]]
                offset = others[0] if len(others) == 1 else (sum(others) if others else None)
            new = self.editor.edit(a, values[last], offset) if self.editor.spans else values[last]
            if self.features.spans:
                new = self.features.apply(a, new, offset)
            if new is not values[last]:
                values[last], changed = new, True
        if group in self._stash_groups and self._editing:
            parts = [values[p] for p in self.table["resid_pre"].parts if values.get(p) is not None]
            self.editor.keep_resid_pre(self._stash_groups[group], parts)
        return changed

    def _input_hook(self, group: Group):
        def hook(module, args, kwargs):
            editing = self._editing and (group in self._edit_groups or group in self._stash_groups)
            if not (self.batch or editing):
                return None
            bound = dict(self._bind(module, args, kwargs))
            one = _unbatch(bound) if (group[1], group[2]) in self._one else ()
            changed = self._apply(group, bound) if editing else False
            if self.batch:
                self._record(group, lambda read: [bound.get(name) for name in read.parts])
            return self._rebind(module, args, kwargs, _rebatch(bound, one)) if changed else None

        return hook

    def _output_hook(self, group: Group):
        def hook(module, args, output):
            editing = self._editing and group in self._edit_groups
            if not (self.batch or editing):
                return None
            many = isinstance(output, (tuple, list))
            items = dict(enumerate(output if many else (output,)))
            one = _unbatch(items) if (group[1], group[2]) in self._one else ()
            changed = self._apply(group, items) if editing else False
            if self.batch:
                self._record(group, lambda read: [items[i] for i in read.parts])
            if not changed:
                return None
            items = _rebatch(items, one)
            values = [items[i] for i in range(len(items))]
            return type(output)(values) if many else values[0]

        return hook

    def _rebind(self, module, args, kwargs, bound: dict):
        """``(args, kwargs)`` with the edited arguments of ``bound`` put back where they came from."""
        names = list(self._signatures[id(module)].parameters)
        args, kwargs = list(args), dict(kwargs)
        for name, value in bound.items():
            if isinstance(name, int):
                args[name] = value
            elif name in kwargs:
                kwargs[name] = value
            elif names.index(name) < len(args):
                args[names.index(name)] = value
        return tuple(args), kwargs

    def _bind(self, module, args, kwargs) -> dict:
        """The forward's arguments by parameter name; those a ``*args`` parameter takes (a custom
        op's ``forward(*args)``) by their position instead."""
        signature = self._signatures.get(id(module))
        if signature is None:
            signature = self._signatures[id(module)] = inspect.signature(module.forward)
        bound = dict(signature.bind_partial(*args, **kwargs).arguments)
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_POSITIONAL and name in bound:
                rest = bound.pop(name)
                bound.update({len(args) - len(rest) + i: value for i, value in enumerate(rest)})
        return bound

    def _record(self, group: Group, operands) -> None:
        for address in self._groups.get(group, ()):
            if not self._keeps(address):
                continue
            selection = self.requests.selection(address)
            if selection is None:
                continue
            read = self.table[address.name]
            parts = [p for p in operands(read) if p is not None]
            if read.layout == "s (b p) d":  # streams first: this address's stream
                parts = [p[address.stream] for p in parts]
            self.requests.keep(address, selection, _select(parts, selection[0]))

    def _on_final_hidden(self, module, args, hidden):
        """The model's output is the final norm's output (vLLM's models end with the norm and
        leave the unembedding to ``compute_logits``): kept as ``final_norm``, and turned into the
        logits at every recorded row through the model's own logits computation.

        Every rank calls it (it gathers the vocabulary shards); rank 0 keeps the results."""
        if not self.batch:
            return
        normed = self.requests.selection(FINAL_NORM)
        if normed is not None and self.tp_rank == 0:
            self.requests.keep(FINAL_NORM, normed, hidden[normed[0]].clone())
        logits = Address(LOGITS)
        selection = self.requests.selection(logits)
        if selection is None:
            return
        values = vllm_compat.compute_logits(self.model, hidden[selection[0]])
        if values is not None and self.tp_rank == 0:
            self.requests.keep(logits, selection, values)


def _unbatch(values: dict) -> tuple:
    """Drop the batch axis of one from every tensor of ``values`` that has it (in place); the keys
    it was dropped from."""
    keys = tuple(k for k, v in values.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == 1)
    for key in keys:
        values[key] = values[key][0]
    return keys


def _rebatch(values: dict, keys: tuple) -> dict:
    """``values`` with the batch axis of one put back on ``keys``."""
    return {k: (v[None] if k in keys else v) for k, v in values.items()}


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

