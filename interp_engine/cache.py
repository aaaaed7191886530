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
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .address import Address, AddressLike, format_address, parse_address, to_address
from .devices import check_device
from .errors import AddressError, CacheFileError, shown

_TOKENS = "__tokens__"
_MASK = "__mask__"
_POSITIONS = "__positions__"
_FORMAT = "interp_engine.cache/1"


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
        n_layers: int | None = None,
    ):
        self._data = {to_address(k): v for k, v in data.items()}
        #: the model's number of layers (set by the capture calls), so that a negative layer in a
        #: lookup (``cache["resid_post", -1]``) counts from the model's end; None: unknown
        self.n_layers = n_layers
        self.tokens = tokens
        self._positions = positions
        if positions is not None:
            self.mask = positions >= 0
        else:
            self.mask = tokens >= 0 if mask is None else mask.bool()
        self.model_name = model_name
        self.backend = backend

    def _key(self, key: AddressLike) -> Address:
        """``key`` as the address it names here: a negative layer counts from the model's end."""
        address = to_address(key)
        if address.layer is None or address.layer >= 0:
            return address
        if self.n_layers is None:
            raise KeyError(f"{format_address(address)!r}: a negative layer counts from the end of the model, and "
                           f"this cache does not know its model's layer count (it was not made by a capture call); "
                           f"use the layer number")
        return Address(address.name, address.layer + self.n_layers, address.stream)

    def __getitem__(self, key: AddressLike) -> torch.Tensor:
        address = self._key(key)
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
            return self._key(key) in self._data
        except (ValueError, KeyError):
            return False

    def __iter__(self) -> Iterator[Address]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    #: how many addresses a repr lists before it summarises the rest
    REPR_ITEMS = 4

    def __repr__(self) -> str:
        """``Cache('SmolLM2-135M-Instruct', eager, 1 x 5 tokens, 31 addresses: resid_post.0 [1, 5, 576], ...)``:
        the addresses and shapes, the first few and the last, never the values."""
        items = [f"{format_address(a)} [{', '.join(map(str, t.shape))}]" for a, t in self._data.items()]
        if len(items) > self.REPR_ITEMS + 1:
            items = items[: self.REPR_ITEMS] + [f"... {len(items) - self.REPR_ITEMS - 1} more", items[-1]]
        name = self.model_name.rstrip("/").rsplit("/", 1)[-1]
        batch, width = self.tokens.shape
        held = f", {self.mask.shape[1]} positions held" if self.selected else ""
        return (f"Cache({name!r}, {self.backend or 'unknown backend'}, {batch} x {width} tokens{held}, "
                f"{len(self._data)} addresses: {', '.join(items) or 'none'})")

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
        return Cache(data, self.tokens, mask, self.model_name, self.backend, positions, self.n_layers)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Cache":
        """A cache with every activation moved to ``device`` (and floating ones cast to ``dtype``);
        tokens, mask and positions stay on the CPU. As ``Tensor.to``, a dtype may come first:
        ``cache.to(torch.float16)``."""
        if isinstance(device, torch.dtype):
            device, dtype = None, device if dtype is None else dtype
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"cache.to: dtype must be a torch.dtype such as torch.float16, got {shown(dtype)}")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise TypeError(f"cache.to: {shown(device)} is neither a device ('cpu', 'cuda', 'cuda:1') nor a "
                                f"torch.dtype") from None
            check_device(device)

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
            "format": _FORMAT,
            "model_name": self.model_name,
            "backend": self.backend,
            "order": json.dumps([format_address(a) for a in self._data]),
        }
        if self.n_layers is not None:
            metadata["n_layers"] = str(self.n_layers)
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path) -> "Cache":
        """Read a cache written by :meth:`save`. A file that is not one, is damaged (truncated,
        edited) or holds tensors whose shapes disagree is refused with :class:`CacheFileError`."""
        metadata, tensors = _read(path)
        data = _activations(path, metadata, tensors)
        tokens, mask, positions = tensors[_TOKENS], tensors[_MASK], tensors.get(_POSITIONS)
        _check_shapes(path, data, tokens, mask, positions)
        n_layers = metadata.get("n_layers", "")
        return cls(data, tokens, mask, str(metadata.get("model_name", "")), str(metadata.get("backend", "")),
                   positions, int(n_layers) if n_layers.isdigit() else None)


def _read(path) -> tuple[dict, dict]:
    """The metadata and tensors of a safetensors file, or a :class:`CacheFileError`."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise CacheFileError(f"{path}: {'is a folder' if Path(path).is_dir() else 'no such file'}; "
                             f"pass the path of a file written by cache.save(path)")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != _FORMAT:
                raise CacheFileError(f"{path} is not an interp_engine cache (no 'format' metadata of {_FORMAT!r}); "
                                     f"read it with safetensors, or save a cache with cache.save(path)")
        tensors = load_file(str(path))
    except (SafetensorError, OSError, MemoryError, ValueError, TypeError) as err:
        if isinstance(err, CacheFileError):
            raise
        raise CacheFileError(f"{path} cannot be read as a safetensors file ({type(err).__name__}: {err}); it is "
                             f"damaged or truncated: save the cache again with cache.save(path)") from None
    return metadata, tensors


def _inconsistent(path, problem: str) -> CacheFileError:
    return CacheFileError(f"{path} is not a consistent interp_engine cache: {problem}; it was edited or "
                          f"damaged: save the cache again with cache.save(path)")


def _activations(path, metadata: dict, tensors: dict) -> dict[Address, torch.Tensor]:
    """The activations the file's ``order`` names, checked against the tensors it holds."""
    try:
        order = json.loads(metadata.get("order", ""))
    except json.JSONDecodeError:
        raise _inconsistent(path, "its 'order' metadata is not JSON") from None
    if not isinstance(order, list) or not all(isinstance(k, str) for k in order):
        raise _inconsistent(path, "its 'order' metadata is not a list of addresses")
    for key in (_TOKENS, _MASK):
        if key not in tensors:
            raise _inconsistent(path, f"it holds no {key} tensor")
    absent = [k for k in order if k not in tensors]
    if absent:
        raise _inconsistent(path, f"its order names {absent[:5]}, which it holds no tensor for")
    extra = sorted(set(tensors) - set(order) - {_TOKENS, _MASK, _POSITIONS})
    if extra:
        raise _inconsistent(path, f"it holds tensors its order does not name: {extra[:5]}")
    try:
        data = {parse_address(k): tensors[k] for k in order}
    except AddressError as err:
        raise _inconsistent(path, f"an entry of its order is not an address ({err})") from None
    if len(data) != len(order):
        raise _inconsistent(path, "its order names an address twice")
    return data


def _check_shapes(path, data: dict, tokens: torch.Tensor, mask: torch.Tensor, positions) -> None:
    """Tokens ``[batch, pos]`` of ints; the mask (and the positions held, if any) of one shape;
    every activation ``[batch, ...]`` with the held positions on its position axis."""
    if tokens.dim() != 2 or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise _inconsistent(path, f"its tokens are {tuple(tokens.shape)} {tokens.dtype}, not [batch, pos] integer ids")
    held = tokens.shape if positions is None else positions.shape
    if positions is not None and (positions.dim() != 2 or positions.shape[0] != tokens.shape[0]
                                  or positions.is_floating_point()):
        raise _inconsistent(path, f"its positions {tuple(positions.shape)} {positions.dtype} are not [batch, held] integers for "
                  f"tokens {tuple(tokens.shape)}")
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(held):
        raise _inconsistent(path, f"its mask is {tuple(mask.shape)} {mask.dtype}, but its "
                  f"{'tokens' if positions is None else 'positions'} are {tuple(held)} (the mask is a bool "
                  f"tensor of that shape)")
    batch, width = held
    for address, tensor in data.items():
        axis = address.query_axis
        if tensor.dim() <= axis or tensor.shape[0] != batch or tensor.shape[axis] != width:
            raise _inconsistent(path, f"{format_address(address)} is {tuple(tensor.shape)}, but the cache holds {batch} rows "
                      f"of {width} positions (its {address.name} tensor is [batch, {'heads, ' * (axis - 1)}"
                      f"pos, ...])")
