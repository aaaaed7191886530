"""The Cache: what a capture returns.

A cache is data: a mapping from :class:`Address` to tensor, plus the few facts needed to read
those tensors — the token ids of the batch, its padding mask, the model's name and the backend.
It keeps no reference to the model, so it can be saved, sent across processes and loaded again.

Every tensor is ``[batch, pos, ...]`` (``pattern`` is ``[batch, head, q_pos, k_pos]``).
``mask[b, p]`` is True at real positions; padded positions hold zeros in every tensor, and
``tokens`` holds ``PAD_ID`` (-1) there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

import torch
from safetensors.torch import load_file, save_file

from .address import Address, AddressLike, format_address, parse_address, to_address

_TOKENS = "__tokens__"
_MASK = "__mask__"


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
    ):
        self._data = {to_address(k): v for k, v in data.items()}
        self.tokens = tokens
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
        """Number of real positions of each sequence."""
        return self.mask.sum(dim=1)

    def to_dict(self) -> dict[Address, torch.Tensor]:
        return dict(self._data)

    def save(self, path) -> None:
        """Write the cache as one safetensors file (no pickle)."""
        tensors = {format_address(a): t.detach().contiguous().cpu() for a, t in self._data.items()}
        tensors[_TOKENS] = self.tokens.contiguous().cpu()
        tensors[_MASK] = self.mask.contiguous().cpu()
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
        return cls(data, tensors[_TOKENS], tensors[_MASK], metadata["model_name"], metadata["backend"])
