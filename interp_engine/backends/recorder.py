"""Hooks on a Hugging Face model, placed from the family's site table.

A :class:`Recorder` is a context manager: on entry it hooks exactly the modules that the
requested addresses need, on exit it removes every hook, whether the forward finished or
raised. Each forward pass through the hooked model appends one chunk per address, so a
generation loop (prefill, then one token at a time with a KV cache) records every position;
:meth:`Recorder.result` joins the chunks along the position axis.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.nn.functional as F

from ..address import Address, ModelInfo
from ..archs import Arch
from ..positions import Selection, gather_positions
from . import attention


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
}


class Recorder:
    def __init__(self, hf_model, arch: Arch, info: ModelInfo, addresses: list[Address], *, detach: bool,
                 stop_early: bool = False, positions: Selection | None = None):
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

    @property
    def layers(self):
        return self.hf.get_submodule(self.arch.layers)

    @property
    def needs_pattern(self) -> bool:
        return any(a.name == "pattern" for a in self.addresses)

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
                pattern = address.name == "pattern"
                tensor = gather_positions(tensor, self._rows(tensor.shape[2 if pattern else 1]), pattern=pattern)
            self.chunks[address].append(tensor.detach() if self.detach else tensor)

    def _rows(self, length: int) -> torch.Tensor:
        """``[batch, k]``: which rows of this forward each sequence keeps (-1: none), computed once
        per forward. Unselected rows are dropped here, before anything is copied or kept."""
        key = (self.start, length)
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
            self._index = (key, index)
        return self._index[1]

    def _install(self) -> None:
        by_module: dict[tuple[int, str, str], list[Address]] = defaultdict(list)
        self._hooks = {}
        for address in self.addresses:
            if address.layer is None:
                continue
            hook = self.arch.sites.get(address.name)
            if hook is None:
                raise ValueError(f"[Internal] the {self.arch.family} table has no entry for {address.name!r}")
            by_module[(address.layer, hook.module, hook.kind)].append(address)
            self._hooks[address] = hook

        for (layer, path, kind), addresses in by_module.items():
            module = self.layers[layer]
            if path:
                module = module.get_submodule(path)
            if kind == "attention":
                self._stack.enter_context(attention.listening(module, self._attention_listener(addresses)))
            elif kind == "in":
                handle = module.register_forward_pre_hook(self._input_hook(addresses), with_kwargs=True)
                self._stack.callback(handle.remove)
            else:
                handle = module.register_forward_hook(self._output_hook(addresses))
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

    def _batch_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._batch = (ids if ids is not None else kwargs["inputs_embeds"]).shape[0]

    def _shape(self, address: Address, tensor: torch.Tensor) -> torch.Tensor:
        hook = self._hooks.get(address)
        if hook is not None and hook.layout:
            tensor = _LAYOUTS[hook.layout](tensor, self._batch, address.stream, self.info.n_streams)
        if address.name == "z":
            return tensor.unflatten(-1, (self.info.n_heads, self.info.d_head))
        return tensor

    def _input_hook(self, addresses):
        def hook(module, args, kwargs):
            tensor = _hidden_input(args, kwargs)
            for a in addresses:
                self.keep(a, self._shape(a, tensor))

        return hook

    def _output_hook(self, addresses):
        def hook(module, args, output):
            for a in addresses:
                index = self._hooks[a].index
                tensor = output[index] if isinstance(output, (tuple, list)) else output
                self.keep(a, self._shape(a, tensor))

        return hook

    def _attention_listener(self, addresses):
        def listener(query, key, value, weights):
            q_len = query.shape[2]
            # With a KV cache the keys and values hold every past position; keep this step's.
            seen = {"q": query, "k": key[:, :, -q_len:], "v": value[:, :, -q_len:]}
            for a in addresses:
                if a.name == "pattern":
                    self.keep(a, weights)
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
            if address.name == "pattern":
                width = chunks[-1].shape[-1]
                chunks = [F.pad(c, (0, width - c.shape[-1])) for c in chunks]
                out[address] = torch.cat(chunks, dim=2) if len(chunks) > 1 else chunks[0]
            else:
                out[address] = torch.cat(chunks, dim=1) if len(chunks) > 1 else chunks[0]
        return out
