"""Edits: writing to activations in the same address space that captures read.

An edit is a value — ``Add``, ``Scale``, ``Set`` or ``Zero`` — keyed by the address it writes:
``edits={"resid_post.3": Add(vector, scale=4.0), "z.1": Zero(heads=[2])}``. It says what
happens to the activation of each edited *position* (a ``[d_model]`` row of a residual site, an
``[n_heads, d_head]`` block of ``z`` / ``q``, ``[n_kv_heads, d_head]`` of ``k`` / ``v``, a
``[d_mlp]`` row of ``mlp_post``, an ``[n_heads, k_pos]`` block of ``pattern``):

- ``Add(vector, scale=1.0)``: ``x + scale * vector``; with ``norm_relative=True`` the vector is
  unit-normed and scaled by each position's own norm, ``x + scale * |x| * vector / |vector|``
  (steering relative to the residual's size, in one pass);
- ``Scale(factor)``: ``factor * x``; ``Set(value)``: ``value`` (broadcast to the edited rows);
  ``Zero()``: zeros (ablation).

Several edits of one address are a list, applied in order, each to what the one before it
wrote: ``{"resid_post.5": [Add(v), Zero(positions=[0])]}`` (every backend).

Directional edits act on the component along a direction and leave the rest: ``Ablate(d)``,
``Cap(d, max=, min=)``, ``Swap(d, projection=)``, ``Rotate(d, angle=)`` (:mod:`.edit_directions`
defines each with its formula).

``positions`` picks the edited positions as a capture's ``positions=`` does (prompt positions,
negative from the end of each prompt, ``"generated"``, ``None`` for all; see :mod:`.positions`);
``heads=[...]`` on the per-head sites (``z``, ``q``, ``k``, ``v``, ``pattern``) edits those heads
only. The edits are plain data, so they travel unchanged to vLLM workers and cluster replicas.
On the eager backend a Python function ``fn(tensor, address) -> tensor`` is also an edit: it
gets the whole ``[batch, pos, ...]`` activation of each forward and returns its replacement
(or None: it only read it, and the activation stays as it was).

Every backend applies an edit where the activation is produced: what runs after it sees the
edited model, and a capture of the edited address itself returns the value after the edit.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import torch

from .address import SITES, Address, to_address
from .points import ModelInfo, check_points
from .capabilities import Capabilities
from .edit_directions import DIRECTIONAL, Ablate, Cap, Rotate, Swap, plan_direction
from .edit_directions import change as _directional
from .edit_rows import dense, per_row_axes
from .edit_values import check_add as _check_add
from .edit_values import number as _number
from .edit_values import tensor as _tensor
from .errors import AddressError, InputError, shown
from .positions import Selection, as_int, check_spec, resolve


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Add:
    """``x + scale * vector`` (``norm_relative``: ``x + scale * |x| * vector / |vector|``)."""

    vector: object
    scale: float = 1.0
    positions: object = None
    norm_relative: bool = False
    heads: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Scale:
    """``factor * x``."""

    factor: float
    positions: object = None
    heads: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Set:
    """``value`` in place of ``x`` (broadcast to the edited rows; or one value per row of the
    batch, ``[batch, *block]`` / ``[batch, n, *block]``: see :mod:`.edit_rows`)."""

    value: object
    positions: object = None
    heads: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Zero:
    """Zeros in place of ``x`` (ablation)."""

    positions: object = None
    heads: tuple | None = None


def _edit_repr(edit) -> str:
    """``Add(Tensor[576] float32, scale=8.0)``: the fields that differ from their defaults, a
    tensor as its shape and dtype (an edit's repr ends up in error messages)."""
    parts = []
    for field in dataclasses.fields(edit):
        value = getattr(edit, field.name)
        if field.default is dataclasses.MISSING:
            parts.append(shown(value))
        elif not (value is field.default or (isinstance(value, (int, float, bool, str, type(None)))
                                             and type(value) is type(field.default) and value == field.default)):
            parts.append(f"{field.name}={shown(value)}")
    return f"{type(edit).__name__}({', '.join(parts)})"


for _cls in (Add, Scale, Set, Zero, *DIRECTIONAL):
    _cls.__repr__ = _edit_repr

Edit = Union[Add, Scale, Set, Zero, Ablate, Cap, Swap, Rotate]
EDITS = (Add, Scale, Set, Zero, *DIRECTIONAL)

#: sites whose per-position block has a head axis (``heads=`` applies)
HEAD_SITES = ("z", "q", "k", "v", "pattern")


@dataclasses.dataclass(frozen=True, eq=False)
class Planned:
    """An edit checked against a model and a batch: the address, the edit (its tensors as
    float32 on the CPU), and the positions it edits in each row (None: every position)."""

    address: Address
    edit: object  # an Edit, or a callable on eager
    selection: Selection | None = None
    #: leading per-row axes of the edit's vector / value (:mod:`.edit_rows`): 0 none,
    #: 1 ``[batch, *block]``, 2 ``[batch, n, *block]``
    per_row: int = 0


def block_shape(address: Address, info: ModelInfo, keys: int = 1) -> tuple[int, ...]:
    """The shape of one position's block at ``address`` (``keys``: key positions of a pattern)."""
    name = address.name
    if name == "z":
        return (info.n_heads, info.d_head)
    if name == "q":
        return (info.n_heads, info.d_head_qk or info.d_head)
    if name == "k":
        return (info.n_kv_heads, info.d_head_qk or info.d_head)
    if name == "v":
        return (info.n_kv_heads, info.d_head)
    if name == "mlp_post":
        return (info.d_mlp,)
    if name == "pattern":
        return (info.n_heads, keys)
    return (info.d_model,)


def check_edits(edits, info: ModelInfo, caps: Capabilities, tokens: torch.Tensor, *,
                generating: bool = False, max_tokens: int | None = None) -> dict[Address, tuple[Planned, ...]] | None:
    """Validate ``edits`` against the model and a checked batch; None when there are none.

    Each address maps to its edits in the order they apply (one edit, or a list of them).

    Raises :class:`AddressError` for an address the backend (its capabilities ``caps``) cannot write and
    :class:`InputError` for an edit that does not fit the address or the batch."""
    if edits is None:
        return None
    if not isinstance(edits, dict):
        raise InputError(f"edits must be a dict of address -> edit, e.g. {{'resid_post.3': Add(vector)}}, "
                         f"got {type(edits).__name__}")
    lengths = (tokens >= 0).sum(dim=1).tolist()
    planned: dict[Address, tuple[Planned, ...]] = {}
    keys: dict[Address, object] = {}
    writable = [s for s in SITES
                if s in caps.writable and (not info.sites or s in info.sites) and s not in caps.unserved]
    for point, edit in edits.items():
        name = _site_name(point)
        if name not in writable:
            why = {**dict(caps.reasons), **dict(info.refused)}.get(name)
            raise AddressError(
                f"{shown(point)} cannot be edited on the {caps.name} backend"
                + (f" ({caps.label} never forms the attention pattern)"
                   if name in SITES and SITES[name].needs_pattern and not caps.forms_pattern else "")
                + (f" ({why})" if why else "")
                + f"; writable sites of this model there: {', '.join(writable)}")
        (address,) = _one_address(point, info, caps)
        if address in planned:
            raise InputError(f"{shown(keys[address])} and {shown(point)} both name {address}: give it one key, with "
                             f"a list of its edits in the order they apply, e.g. {{'{address}': [Add(v), Zero()]}}")
        keys[address] = point
        chain = list(edit) if isinstance(edit, (list, tuple)) else [edit]
        if not chain:
            raise InputError(f"edits on {address}: the list is empty; give at least one edit (or leave the "
                             f"address out)")
        planned[address] = tuple(_plan(address, e, info, caps, tokens, lengths, generating, max_tokens)
                                 for e in chain)
    return planned or None


def _site_name(point) -> str:
    """The site an edit's key names (an unknown one is an AddressError listing the known)."""
    if isinstance(point, str):
        name = point.split(".")[0]
        if name in SITES:
            return name
    return to_address(point).name


def _one_address(point, info, caps) -> list[Address]:
    addresses = check_points([point], info, caps)
    if len(addresses) != 1 or addresses[0].layer is None:
        raise AddressError(f"an edit writes one layer's address such as 'resid_post.3', got {shown(point)}")
    return addresses


def _plan(address, edit, info, caps, tokens, lengths, generating, max_tokens) -> Planned:
    if callable(edit) and not isinstance(edit, EDITS):
        if not caps.function_edits:
            raise InputError(
                f"edit on {address}: a Python function is an edit on the eager backend only; the {caps.name} backend "
                f"takes edits as data: Add(vector), Scale(factor), Set(value), Zero(), or a directional edit "
                f"(Ablate, Cap, Swap, Rotate), with positions=, heads=")
        return Planned(address, edit)
    if not isinstance(edit, EDITS):
        raise InputError(f"edit on {address}: {shown(edit)} is not an edit; use Add(vector), Scale(factor), "
                         f"Set(value), Zero(), a directional edit such as Ablate(direction) (or a function on "
                         f"eager)")
    heads = _check_heads(address, edit.heads, info)
    positions = check_spec(edit.positions)
    try:
        selection = resolve(positions, lengths, generating=generating, max_tokens=max_tokens)
    except InputError as error:
        raise InputError(f"edit on {address}: {error}") from None
    block = block_shape(address, info, tokens.shape[1])
    if heads is not None:
        block = (len(heads), *block[1:])
    changes = {"heads": heads, "positions": positions}
    per_row = 0

    def fitted(name, value):
        nonlocal per_row
        tensor = _tensor(address, name, value)
        per_row = per_row_axes(address, name, tensor, block, tokens, selection, generating)
        return tensor if per_row else _fit(address, name, tensor, block)

    if isinstance(edit, Add):
        changes["vector"] = fitted("Add's vector", edit.vector)
        changes["scale"] = _number(address, "Add's scale", edit.scale)
        if not isinstance(edit.norm_relative, bool):
            raise InputError(f"edit on {address}: norm_relative must be True or False, got {shown(edit.norm_relative)}")
        if edit.norm_relative and per_row:
            raise InputError(f"edit on {address}: norm_relative=True takes one direction for every row; give a "
                             f"vector of one position's block, or norm_relative=False for a vector per row")
        _check_add(address, changes["vector"], changes["scale"], edit.norm_relative)
    elif isinstance(edit, Scale):
        changes["factor"] = _number(address, "Scale's factor", edit.factor)
    elif isinstance(edit, Set):
        changes["value"] = fitted("Set's value", edit.value)
    elif isinstance(edit, DIRECTIONAL):
        changes.update(plan_direction(address, edit, block))
    return Planned(address, dataclasses.replace(edit, **changes), selection, per_row)


def _check_heads(address, heads, info) -> tuple[int, ...] | None:
    if heads is None:
        return None
    if address.name not in HEAD_SITES:
        raise InputError(f"edit on {address}: heads= applies to the per-head sites {', '.join(HEAD_SITES)}; "
                         f"{address.name} has no head axis (drop heads=, or edit z.{address.layer})")
    if as_int(heads) is not None:
        heads = [heads]
    n = info.n_kv_heads if address.name in ("k", "v") else info.n_heads
    heads = list(heads) if isinstance(heads, (list, tuple, range)) else heads
    if not isinstance(heads, list) or not heads or any(as_int(h) is None for h in heads):
        raise InputError(f"edit on {address}: heads must be a non-empty list of ints, got {shown(heads)}")
    heads = [as_int(h) for h in heads]
    bad = [h for h in heads if not 0 <= h < n]
    if bad:
        raise InputError(f"edit on {address}: head {bad[0]} is out of range; {address.name} has {n} heads "
                         f"(valid: 0..{n - 1})")
    return tuple(sorted(set(heads)))


def _fit(address, name, value, block) -> torch.Tensor:
    """``value`` as a tensor that broadcasts to one position's ``block``."""
    tensor = _tensor(address, name, value)
    shape = tuple(tensor.shape)
    ok = len(shape) <= len(block) and all(s in (1, b) for s, b in zip(shape[::-1], block[::-1]))
    if not ok:
        wanted = f"[{', '.join(map(str, block))}]"
        raise InputError(f"edit on {address}: {name} of shape {list(shape)} does not fit: each edited position "
                         f"of {address.name} is {wanted} (the {name.split()[-1]} broadcasts to it, or gives one per "
                         f"row: [batch, *block], [batch, n, *block])")
    return tensor


def apply_edit(edit: Edit, block: torch.Tensor) -> torch.Tensor:
    """The edited value of ``block`` (``[..., *one position's block]``), a new tensor; a pure
    function. ``heads`` index the head axis (the first axis of a position's block)."""
    heads = getattr(edit, "heads", None)
    if heads is None:
        return _change(edit, block)
    index = torch.tensor(heads, dtype=torch.long, device=block.device)
    axis = block.dim() - 2  # the head axis of [..., heads, d]
    new = _change(edit, block.index_select(axis, index))
    return block.index_copy(axis, index, new)


def _change(edit: Edit, x: torch.Tensor) -> torch.Tensor:
    if isinstance(edit, DIRECTIONAL):
        return _directional(edit, x)
    if isinstance(edit, Zero):
        return torch.zeros_like(x)
    if isinstance(edit, Scale):
        return x * edit.factor
    if isinstance(edit, Set):
        return edit.value.to(x.dtype).to(x.device).expand_as(x).clone()
    vector = edit.vector.to(x.device, torch.float32)
    if edit.norm_relative:
        # the norm of each position's own block, over its last axis (the residual's d_model)
        unit = vector / vector.norm()
        return (x.float() + edit.scale * x.float().norm(dim=-1, keepdim=True) * unit).to(x.dtype)
    return x + (edit.scale * vector).to(x.dtype)


def edited_positions(selection: Selection | None, start: int, length: int, batch: int) -> torch.Tensor | None:
    """``[batch, length]``: which rows of a forward that starts at position ``start`` are edited
    (None: all)."""
    if selection is None:
        return None
    absolute = torch.arange(start, start + length)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row in range(batch):
        mask[row] = torch.isin(absolute, torch.tensor(selection.rows[row], dtype=torch.long))
        if selection.after[row] is not None:
            mask[row] |= absolute >= selection.after[row]
    return mask


def edit_chain(chain: tuple[Planned, ...], tensor: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``tensor`` after every edit of ``chain`` in order, each applied to what the one before wrote
    (see :func:`edit_activation`)."""
    for planned in chain:
        tensor = edit_activation(planned, tensor, start)
    return tensor


class Transform:
    """An edit the engine builds itself rather than a user's value: a function of one forward's
    whole ``[batch, pos, ...]`` activation and the position its first row is (a dictionary's
    feature-space edits, :mod:`interp_engine.features.run`). Planned like any edit, it runs on
    every backend that runs the engine's code where the activation is produced."""

    def edit_at(self, tensor: torch.Tensor, start: int) -> torch.Tensor:
        raise NotImplementedError


def edit_activation(planned: Planned, tensor: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The edited ``[batch, pos, ...]`` activation at ``planned.address`` of one forward whose
    first row is position ``start`` (a KV-cached decode step starts later); a new tensor."""
    edit = planned.edit
    if isinstance(edit, Transform):
        return edit.edit_at(tensor, start)
    if not isinstance(edit, EDITS):
        out = edit(tensor, planned.address)
        if out is None:  # a function that only reads (as a TransformerLens hook may) changes nothing
            return tensor
        if not isinstance(out, torch.Tensor) or out.shape != tensor.shape:
            raise InputError(f"the function edit on {planned.address} must return a tensor of shape "
                             f"{list(tensor.shape)}, got {getattr(out, 'shape', type(out).__name__)}")
        return out
    if planned.per_row:
        edit = dense(planned, start, tensor.shape[1])
    new = apply_edit(edit, tensor)
    mask = edited_positions(planned.selection, start, tensor.shape[1], tensor.shape[0])
    if mask is None:
        return new
    mask = mask.reshape(*mask.shape, *([1] * (tensor.dim() - 2))).to(tensor.device)
    return torch.where(mask, new, tensor)
