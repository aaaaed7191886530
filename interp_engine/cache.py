"""The Cache: what a capture returns.

A cache is data: a mapping from :class:`Address` to tensor, plus the few facts needed to read
those tensors — the token ids of the batch, its padding mask, the model's name and the backend.
It keeps no reference to the model, so it can be saved, sent across processes and loaded again.

Every tensor is ``[batch, pos, ...]`` (``pattern`` is ``[batch, head, q_pos, k_pos]``).
``mask[b, p]`` is True at real positions; padded positions hold zeros in every tensor, and
``tokens`` holds ``PAD_ID`` (-1) there.

A capture with ``positions=`` (see :mod:`.positions`) holds only some positions: then the
tensors' position axis runs over ``positions[b, i]`` (``-1`` where a row holds fewer than the
widest), ``mask`` is ``positions >= 0``, and ``tokens`` is still the whole input.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

import torch
from safetensors.torch import load_file, save_file

from .address import Address, AddressLike, format_address, parse_address, to_address

_TOKENS = "__tokens__"
_MASK = "__mask__"
_POSITIONS = "__positions__"


class Cache(Mapping):
    """Captured activations keyed by :class:`Address`.

    >>> cache["resid_post.10"] is cache[Address("resid_post", 10)]  # doctest: +SKIP
    >>> cache.get("mlp_out", 10)                                     # doctest: +SKIP
    """

    def __init__(
        self,
        data: Mapping[Address, torch.Tensor],
        tokens: torch.Tensor,
        mask: torch.Tensor | None = None,
        model_name: str = "",
        backend: str = "",
        positions: torch.Tensor | None = None,
    ):
        self._data = {to_address(k): v for k, v in data.items()}
        self.tokens = tokens
        self._positions = positions
        if positions is not None:
            self.mask = positions >= 0
        else:
            self.mask = tokens >= 0 if mask is None else mask.bool()
        self.model_name = model_name
        self.backend = backend

    def __getitem__(self, key: AddressLike) -> torch.Tensor:
        address = to_address(key)
        try:
            return self._data[address]
        except KeyError:
            held = ", ".join(format_address(a) for a in self._data) or "nothing"
            raise KeyError(f"{format_address(address)!r} was not captured; this cache holds: {held}") from None

    def get(self, name: str, layer: int | None = None, stream: int | None = None) -> torch.Tensor:
        """``cache.get("resid_post", 10)`` is ``cache[Address("resid_post", 10)]``."""
        return self[Address(name, layer, stream)]

    def __contains__(self, key) -> bool:
        try:
            return to_address(key) in self._data
        except ValueError:
            return False

    def __iter__(self) -> Iterator[Address]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        items = ", ".join(f"{format_address(a)}: {tuple(t.shape)}" for a, t in self._data.items())
        return f"Cache({self.model_name!r}, backend={self.backend!r}, tokens={tuple(self.tokens.shape)}, {{{items}}})"

    @property
    def lengths(self) -> torch.Tensor:
        """Number of positions each row holds."""
        return self.mask.sum(dim=1)

    @property
    def positions(self) -> torch.Tensor:
        """``[batch, held]``: the position of each held column, -1 where a row holds fewer."""
        if self._positions is not None:
            return self._positions
        return torch.where(self.mask, torch.arange(self.mask.shape[1]), torch.full((), -1))

    @property
    def selected(self) -> bool:
        """Whether this cache holds a selection of positions (``positions=`` at capture)."""
        return self._positions is not None

    def _like(self, data, positions=None) -> "Cache":
        positions = self._positions if positions is None else positions
        mask = None if positions is not None else self.mask
        return Cache(data, self.tokens, mask, self.model_name, self.backend, positions)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Cache":
        """A cache with every activation moved to ``device`` (and floating ones cast to ``dtype``);
        tokens, mask and positions stay on the CPU."""
        def move(t):
            return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)

        return self._like({a: move(t) for a, t in self._data.items()})

    def select(self, positions) -> "Cache":
        """The same cache at fewer positions, chosen as ``positions=`` chooses them at capture
        (resolved against each row's tokens; see :mod:`interp_engine.positions`)."""
        from .positions import check_spec, gather_positions, resolve

        spec = check_spec(positions)
        lengths = (self.tokens >= 0).sum(dim=1).tolist()
        selection = resolve(spec, lengths)
        if selection is None:
            return self
        held = self.positions
        index = torch.full((len(lengths), selection.width()), -1, dtype=torch.long)
        for row, wanted in enumerate(selection.rows):
            columns = {int(p): i for i, p in enumerate(held[row].tolist()) if p >= 0}
            missing = [p for p in wanted if p not in columns]
            if missing:
                raise KeyError(f"positions {missing} of row {row} are not held by this cache "
                               f"(it holds {sorted(columns)})")
            index[row, : len(wanted)] = torch.tensor([columns[p] for p in wanted], dtype=torch.long)
        new_positions = torch.where(index >= 0, held.gather(1, index.clamp(min=0)), torch.full((), -1))
        data = {a: gather_positions(t, index, axis=a.query_axis) for a, t in self._data.items()}
        return self._like(data, new_positions)

    def to_dict(self) -> dict[Address, torch.Tensor]:
        return dict(self._data)

    def save(self, path) -> None:
        """Write the cache as one safetensors file (no pickle)."""
        tensors = {format_address(a): t.detach().contiguous().cpu() for a, t in self._data.items()}
        tensors[_TOKENS] = self.tokens.contiguous().cpu()
        tensors[_MASK] = self.mask.contiguous().cpu()
        if self._positions is not None:
            tensors[_POSITIONS] = self._positions.contiguous().cpu()
        metadata = {
            "format": "interp_engine.cache/1",
            "model_name": self.model_name,
            "backend": self.backend,
            "order": json.dumps([format_address(a) for a in self._data]),
        }
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path) -> "Cache":
        """Read a cache written by :meth:`save`."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        if metadata.get("format") != "interp_engine.cache/1":
            raise ValueError(f"{path} is not an interp_engine cache (no 'format' metadata)")
        tensors = load_file(str(path))
        order = json.loads(metadata["order"])
        data = {parse_address(k): tensors[k] for k in order}
        return cls(data, tensors[_TOKENS], tensors[_MASK], metadata["model_name"], metadata["backend"],
                   tensors.get(_POSITIONS))
