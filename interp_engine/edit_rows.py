"""Batched activation patching: an ``Add`` vector or ``Set`` value with one value per row.

An edit's tensor normally has the shape of one position's block (``[d_model]``, ``[n_heads,
d_head]``, ...) and is broadcast to every edited position of every row. With leading axes it
carries a value per row of the batch, so one forward patches each prompt with its own value (a
patching sweep in one request instead of one per prompt):

- ``[batch, *block]``: row ``b``'s value at each position it edits (``Set(clean[:, 3],
  positions=[3])``);
- ``[batch, n, *block]``: row ``b``'s value at each of the ``n`` positions it edits, in
  position order (``positions=`` must pick ``n`` prompt positions in every row), or, with
  ``positions=None``, at every position of the batch (``n`` = the batch's width: a whole
  ``[batch, pos, ...]`` tensor).

The values travel as data: a vLLM request gets its own row's value (:func:`one_row`), and a
cluster splits them with the rows it sends to each replica (``wire.edits_for_rows``).
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import InputError


def per_row_axes(address, name: str, tensor: torch.Tensor, block: tuple, tokens: torch.Tensor, selection,
                 generating: bool) -> int:
    """How many leading per-row axes ``tensor`` carries beyond one position's ``block`` (0: none,
    1: ``[batch, *block]``, 2: ``[batch, n, *block]``), checked against the batch and the
    positions the edit selects."""
    extra = tensor.dim() - len(block)
    if extra <= 0:
        return 0
    shape, wanted = list(tensor.shape), f"[{', '.join(map(str, block))}]"
    batch, width = tokens.shape
    if extra > 2:
        raise InputError(f"edit on {address}: {name} of shape {shape} has {extra} axes before one position's block "
                         f"{wanted}; give {wanted}, one value per row [batch, *block] or one per row and edited "
                         f"position [batch, n, *block]")
    inner = shape[extra:]
    if len(inner) != len(block) or any(s not in (1, b) for s, b in zip(inner, block)):
        raise InputError(f"edit on {address}: {name} of shape {shape} does not end in one position's block "
                         f"{wanted} (a value per row is [batch, *block]; per row and position [batch, n, *block])")
    if shape[0] != batch:
        raise InputError(f"edit on {address}: {name} of shape {shape} holds a value per row (its first axis), but "
                         f"the batch has {batch} row{'s' * (batch != 1)}; give one per row, or {wanted} for all")
    if extra == 1:
        return 1
    if address.query_axis != 1:
        raise InputError(f"edit on {address}: a value per position is not taken for {address.name}; give "
                         f"{wanted} or one per row [batch, *block]")
    n = shape[1]
    if selection is None:
        if generating:
            raise InputError(f"edit on {address}: {name} of shape {shape} gives a value at every position, which "
                             f"cannot cover the positions a generation adds; pick prompt positions with "
                             f"positions= or give one value per row [batch, *block]")
        if n != width:
            raise InputError(f"edit on {address}: {name} of shape {shape} gives {n} values per row, but with "
                             f"positions=None it edits all {width} positions of the batch; give {width}, or pick "
                             f"{n} positions with positions=")
        return 2
    if any(after is not None for after in selection.after):
        raise InputError(f"edit on {address}: a value per position covers prompt positions only, not "
                         f"'generated'; give one value per row [batch, *block] for those")
    counts = sorted({len(rows) for rows in selection.rows})
    if counts != [n]:
        raise InputError(f"edit on {address}: {name} of shape {shape} gives {n} values per row, but positions= "
                         f"picks {' or '.join(map(str, counts))} positions per row")
    return 2


def _field(edit) -> str:
    return "vector" if hasattr(edit, "vector") else "value"


def dense(planned, start: int, length: int):
    """``planned.edit`` with its per-row tensor laid out for one forward of ``length`` positions
    starting at ``start``: ``[batch, 1, *block]`` (a value per row) or ``[batch, length, *block]``
    (row ``b``'s value for each position; positions it does not edit get any value, since the
    edit's position mask leaves them alone)."""
    edit = planned.edit
    field = _field(edit)
    value = getattr(edit, field)
    if planned.per_row == 1:
        return dataclasses.replace(edit, **{field: value[:, None]})
    batch, n = value.shape[:2]
    index = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        if planned.selection is None:
            columns = {p: p for p in range(n)}
        else:
            columns = {p: j for j, p in enumerate(planned.selection.rows[row])}
        index[row] = torch.tensor([columns.get(start + t, 0) for t in range(length)], dtype=torch.long)
    rows = torch.arange(batch, device=value.device)[:, None]
    return dataclasses.replace(edit, **{field: value[rows, index.to(value.device)]})


def one_row(planned, row: int) -> tuple[object, list[int] | None, bool]:
    """The edit as it applies to ``row`` alone (one engine request): ``(edit, positions,
    per_position)``. A value per row becomes that row's ordinary value; a value per position
    becomes that row's ``[n, *block]`` values with the positions they go to."""
    edit, selection = planned.edit, planned.selection
    positions = None if selection is None else list(selection.rows[row])
    if not planned.per_row:
        return edit, positions, False
    field = _field(edit)
    value = getattr(edit, field)[row]
    if planned.per_row == 1:
        return dataclasses.replace(edit, **{field: value}), positions, False
    if positions is None:
        positions = list(range(value.shape[0]))
    return dataclasses.replace(edit, **{field: value}), positions, True


def row_edit(planned, row: int, length: int):
    """The edit as the caller would give it for ``row`` alone, run at its own ``length``: a value
    per row cut to that row (``[1, *block]`` / ``[1, n, *block]``; a value for every position of
    the batch also to the row's length). The positions spec is kept as given: each row resolves
    it against its own length, as in the batch."""
    edit = planned.edit
    if not planned.per_row:
        return edit
    field = _field(edit)
    value = getattr(edit, field)[row:row + 1]
    if planned.per_row == 2 and planned.selection is None:
        value = value[:, :length]
    return dataclasses.replace(edit, **{field: value})
