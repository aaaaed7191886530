"""Hooks on a Hugging Face model, placed from the family's site table.

A :class:`Recorder` is a context manager: on entry it hooks exactly the modules that the
requested addresses need, on exit it removes every hook, whether the forward finished or
raised. Each forward pass through the hooked model appends one chunk per address, so a
generation loop (prefill, then one token at a time with a KV cache) records every position;
:meth:`Recorder.result` joins the chunks along the position axis.

Edits (see :mod:`interp_engine.edits`) go through the same table: the hook that reads a site
also writes it, editing first, so a capture of the edited address sees the edited value and
every later module computes from it. ``resid_mid`` is a local variable of a decoder layer, so
it is written through what the attention block adds (the identity ``resid_mid = resid_pre +
attn_out_post``): ``attn_out_post' = edited(resid_pre + attn_out_post) - resid_pre``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import defaultdict

import torch
import torch.nn.functional as F

from interp_engine.address import SITES, Address
from interp_engine.points import ModelInfo
from interp_engine.archs import Arch, group_sites
from interp_engine.archs.base import layer_module
from interp_engine.edits import Planned, edit_chain
from interp_engine.positions import Selection, gather_positions
from . import attention
from .attention_edits import AttentionEditor
from .norms import pre_gain
from ..heads import split_heads


def _on_device(planned: Planned, device: torch.device) -> Planned:
    """``planned`` with its edit's tensors on ``device``, moved once per request: a copy from host
    memory waits for the GPU, so moving a vector at every hook call would stall every layer of
    every forward (and every decode step)."""
    edit = planned.edit
    if not dataclasses.is_dataclass(edit):  # a function edit: it places its own tensors
        return planned
    tensors = {f.name: getattr(edit, f.name) for f in dataclasses.fields(edit)}
    tensors = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.device != device}
    if not tensors:
        return planned
    moved = copy.copy(edit)
    for name, value in tensors.items():
        object.__setattr__(moved, name, value.to(device))  # the edit types are frozen
    return dataclasses.replace(planned, edit=moved)


FINAL_NORM = Address("final_norm")


class StopForward(Exception):
    """Raised by a hook once every requested layer has run, to skip the rest of the model."""


def _hidden_input(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


#: how to turn each table layout (see ``archs.LAYOUTS``) into ``[batch, pos, ...]``, given the
#: batch size, the stream wanted and the number of streams
_LAYOUTS = {
    "": lambda t, batch, s, n: t,
    "(b p) ...": lambda t, batch, s, n: t.unflatten(0, (batch, -1)),
    "b p s d": lambda t, batch, s, n: t[:, :, s].clone(),
    "s b p d": lambda t, batch, s, n: t[s].clone(),
    "b p (s d)": lambda t, batch, s, n: t.unflatten(-1, (n, -1))[:, :, s].clone(),
    "b h p d": lambda t, batch, s, n: t.transpose(1, 2),
}


#: a multi-stream layout as ``[batch, pos, stream, d]`` and back (for writing one stream)
_STREAM_VIEWS = {
    "b p s d": (lambda t, n: t, lambda t: t),
    "s b p d": (lambda t, n: t.permute(1, 2, 0, 3), lambda t: t.permute(2, 0, 1, 3)),
    "b p (s d)": (lambda t, n: t.unflatten(-1, (n, -1)), lambda t: t.flatten(-2)),
}


class Recorder:
    def __init__(self, hf_model, arch: Arch, info: ModelInfo, addresses: list[Address], *, detach: bool,
                 stop_early: bool = False, positions: Selection | None = None,
                 edits: dict[Address, tuple[Planned, ...]] | None = None):
        self.hf = hf_model
        self.arch = arch
        self.info = info
        self.addresses = list(addresses)
        self.detach = detach
        self.stop_early = stop_early
        self._wanted = set(self.addresses)
        self.chunks: dict[Address, list[torch.Tensor]] = defaultdict(list)
        self._stack = contextlib.ExitStack()
        self._batch = 1
        self.positions = positions
        #: the absolute position of this forward's first row (a KV-cached decode step starts later)
        self.start = 0
        self._index: tuple | None = None
        device = next(hf_model.parameters()).device
        self.edits = {a: tuple(_on_device(p, device) for p in chain) for a, chain in (edits or {}).items()}
        # hook key -> the edits applied there, in forward order; layer -> its (edited) input
        self._edit_at: dict[tuple, list[Address]] = defaultdict(list)
        self._stash: dict[tuple, int] = {}
        self._resid_pre: dict[int, torch.Tensor] = {}

    @property
    def layers(self):
        return self.hf.get_submodule(self.arch.layers)

    @property
    def needs_pattern(self) -> bool:
        return any(getattr(SITES.get(a.name), "needs_pattern", False) for a in [*self.addresses, *self.edits])

    def __enter__(self):
        try:
            self._install()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def keep(self, address: Address, tensor: torch.Tensor) -> None:
        """Record one chunk for ``address`` if it was requested (the model-level logits come
        from the forward's output rather than a hook)."""
        if address in self._wanted:
            if self.positions is not None:
                axis = address.query_axis
                index, complete = self._rows(tensor.shape[axis], tensor.device)
                tensor = gather_positions(tensor, index, axis=axis, complete=complete)
            self.chunks[address].append(tensor.detach() if self.detach else tensor)

    def _rows(self, length: int, device: torch.device) -> tuple[torch.Tensor, bool]:
        """``[batch, k]`` on ``device``: which rows of this forward each sequence keeps (-1: none),
        and whether every entry is a row; computed and moved once per forward, not at every hook.
        Unselected rows are dropped here, before anything is copied or kept."""
        key = (self.start, length, device)
        if self._index is None or self._index[0] != key:
            sel, start = self.positions, self.start
            kept = []
            for row, wanted in enumerate(sel.rows):
                local = [p - start for p in wanted if start <= p < start + length]
                if sel.after[row] is not None:
                    local += range(max(sel.after[row], start) - start, length)
                kept.append(local)
            index = torch.full((len(kept), max(len(k) for k in kept)), -1, dtype=torch.long)
            for row, local in enumerate(kept):
                index[row, : len(local)] = torch.tensor(local, dtype=torch.long)
            self._index = (key, (index.to(device), bool((index >= 0).all())))
        return self._index[1]

    def _install(self) -> None:
        # feature points (interp_engine.features) are recorded by their dictionaries' edits, not hooked
        sites = [a for a in self.addresses if isinstance(a, Address)]
        by_module = group_sites(sites, self.arch.sites)
        self._hooks = {a: self.arch.sites[a.name] for a in sites if a.layer is not None}
        for address in self.edits:
            hook = self._write_hook(address)
            key = (address.layer, hook.module, hook.phase)
            by_module.setdefault(key, [])
            self._edit_at[key].append(address)
            if address.name == "resid_mid":
                pre = self.arch.sites["resid_pre"]
                self._stash[(address.layer, pre.module, pre.phase)] = address.layer
                by_module.setdefault((address.layer, pre.module, pre.phase), [])

        for address in sites:  # model-level reads the family record names (the embedding, the unembedding)
            if address.layer is None and address.name in self.arch.sites:
                hook = self._hooks[address] = self.arch.sites[address.name]
                by_module.setdefault((None, hook.module, hook.phase), []).append(address)
        for key, addresses in by_module.items():
            layer, path, kind = key
            module = self.hf.get_submodule(path) if layer is None else layer_module(self.layers[layer], path)
            if kind == "attention":
                if addresses:
                    self._stack.enter_context(attention.listening(module, self._attention_listener(addresses)))
                if self._edit_at.get(key):
                    self._stack.enter_context(attention.editing(module, AttentionEditor(self, self._edit_at[key])))
            elif kind == "in":
                handle = module.register_forward_pre_hook(self._input_hook(key, addresses), with_kwargs=True)
                self._stack.callback(handle.remove)
            elif kind == "normalized":
                handle = module.register_forward_pre_hook(self._normalized_hook(key, addresses), with_kwargs=True)
                self._stack.callback(handle.remove)
            else:
                handle = module.register_forward_hook(self._output_hook(key, addresses))
                self._stack.callback(handle.remove)
        if FINAL_NORM in self._wanted:  # the final norm's output, what the unembedding reads
            norm = self.hf.get_submodule(self.arch.final_norm)
            handle = norm.register_forward_hook(lambda module, args, out: self.keep(FINAL_NORM, out))
            self._stack.callback(handle.remove)
        if any(h.layout == "(b p) ..." for h in self._hooks.values()):
            handle = self.hf.register_forward_pre_hook(self._batch_hook, with_kwargs=True)
            self._stack.callback(handle.remove)
        if self.needs_pattern:
            self._stack.enter_context(attention.using(self.hf, attention.EAGER))
        layered = [a.layer for a in self.addresses if a.layer is not None]
        if self.stop_early and layered:
            last = max(layered)
            handle = self.layers[last].register_forward_hook(self._stop)
            self._stack.callback(handle.remove)

    def _write_hook(self, address: Address):
        """Where an edit of ``address`` is written: its own hook, except resid_mid, written through
        attn_out_post from the layer's input (see the module docstring)."""
        return self.arch.sites["attn_out_post" if address.name == "resid_mid" else address.name]

    def _batch_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._batch = (ids if ids is not None else kwargs["inputs_embeds"]).shape[0]

    def _shape(self, address: Address, tensor: torch.Tensor) -> torch.Tensor:
        hook = self._hooks.get(address)
        if hook is not None and hook.layout:
            tensor = _LAYOUTS[hook.layout](tensor, self._batch, address.stream, self.info.n_streams)
        return split_heads(address.name, tensor, self.info)

    def _edit(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` after the edits applied at hook ``key`` (the same tensor when there are none)."""
        for address in self._edit_at.get(key, ()):
            chain = self.edits[address]
            if address.name == "resid_mid":
                pre = self._resid_pre[address.layer]
                tensor = edit_chain(chain, pre + tensor, self.start) - pre
            elif address.name == "z":
                heads = split_heads(address.name, tensor, self.info)
                tensor = edit_chain(chain, heads, self.start).flatten(-2)
            elif address.name == "resid_streams":
                tensor = self._edit_stream(address, chain, tensor)
            else:
                tensor = edit_chain(chain, tensor, self.start)
        if key in self._stash:
            self._resid_pre[self._stash[key]] = tensor
        return tensor

    def _edit_stream(self, address: Address, chain: tuple[Planned, ...], tensor: torch.Tensor) -> torch.Tensor:
        """Edit one stream of a layer's multi-stream output, in the table's layout (a single-stream
        model's only stream is the output itself)."""
        layout, s = self.arch.sites["resid_streams"].layout, address.stream
        if not layout:
            return edit_chain(chain, tensor, self.start)
        to_bpsd, from_bpsd = _STREAM_VIEWS[layout]
        streams = to_bpsd(tensor, self.info.n_streams)
        edited = edit_chain(chain, streams[:, :, s], self.start)
        out = streams.clone()
        out[:, :, s] = edited
        return from_bpsd(out)

    def _input_hook(self, key, addresses):
        def hook(module, args, kwargs):
            given = _hidden_input(args, kwargs)
            tensor = self._edit(key, given)
            for a in addresses:
                self.keep(a, self._shape(a, tensor))
            if tensor is not given:
                if args:
                    return (tensor, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": tensor}
            return None

        return hook

    def _normalized_hook(self, key, addresses):
        """Read the norm's output before its gain, recomputed from its input (:mod:`.norms`); the
        forward goes on unchanged (a dictionary reading here only encodes)."""
        def hook(module, args, kwargs):
            tensor = self._edit(key, pre_gain(module, _hidden_input(args, kwargs)))
            for a in addresses:
                self.keep(a, tensor)

        return hook

    def _output_hook(self, key, addresses):
        written = self._edit_at.get(key)
        index = self._write_hook(written[0]).index if written else 0

        def hook(module, args, output):
            edited = output
            if self._edit_at.get(key):
                many = isinstance(output, (tuple, list))
                given = output[index] if many else output
                tensor = self._edit(key, given)
                if tensor is not given:
                    edited = (*output[:index], tensor, *output[index + 1:]) if many else tensor
            for a in addresses:
                index_a = self._hooks[a].index
                tensor = edited[index_a] if isinstance(edited, (tuple, list)) else edited
                self.keep(a, self._shape(a, tensor))
            return edited if edited is not output else None

        return hook

    def _attention_listener(self, addresses):
        def listener(query, key, value, weights, scores):
            q_len = query.shape[2]
            # With a KV cache the keys and values hold every past position; keep this step's.
            seen = {"q": query, "k": key[:, :, -q_len:], "v": value[:, :, -q_len:]}
            for a in addresses:
                if a.name == "pattern":
                    self.keep(a, weights)
                elif a.name == "attn_scores":
                    self.keep(a, scores())
                else:
                    self.keep(a, seen[a.name].transpose(1, 2))

        return listener

    @staticmethod
    def _stop(module, args, output):
        raise StopForward

    def result(self) -> dict[Address, torch.Tensor]:
        out = {}
        for address in self.addresses:
            chunks = self.chunks[address]
            if len(address.position_axes) > 1:  # keys too (pattern): each step sees more of them
                width = chunks[-1].shape[-1]
                fill = torch.finfo(chunks[-1].dtype).min if SITES[address.name].masked_min else 0.0
                chunks = [F.pad(c, (0, width - c.shape[-1]), value=fill) for c in chunks]
                out[address] = torch.cat(chunks, dim=address.query_axis) if len(chunks) > 1 else chunks[0]
            else:
                out[address] = torch.cat(chunks, dim=address.query_axis) if len(chunks) > 1 else chunks[0]
        return out
