"""Positions: which rows of the position axis a capture keeps.

Every call that captures takes ``positions=``:

- ``None``: every position (the default);
- an int or a list of ints: those positions of the *prompt*; a negative one counts from the end
  of each prompt (``-1`` is each row's own last real token, however the batch is padded);
- a slice, resolved against each prompt's length as Python slices a list (``slice(-3, None)``:
  the last three prompt tokens; bounds are clipped, as Python clips them);
- ``"prompt"``: every prompt position; ``"generated"``: only the positions computed while
  generating (the generated tokens fed back, ``len(prompt) ..``), for ``capture_generation``.

A selection is a *set*: positions are kept in position order, each once. It is applied where the
activation is produced (in the eager hooks, inside each vLLM worker, inside each replica), so an
unselected row is never copied, kept or sent. The Cache says which positions it holds:
``cache.positions[b, i]`` is the position of column ``i`` of row ``b`` (``-1`` where a row holds
fewer columns than the widest one; those hold zeros, and ``cache.mask`` is False there).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .errors import InputError, shown
from .scalars import integer

_WORDS = ("prompt", "generated")
_FORMS = ("None (all), an int or a list of ints (negative from the end of the prompt: -1 = last prompt token), "
          "a slice, 'prompt' or 'generated'")


@dataclasses.dataclass(frozen=True)
class Selection:
    """A positions spec resolved against a batch: per row, the prompt positions kept, and from
    which position on every generated position is kept (``after``; None: none)."""

    rows: tuple[tuple[int, ...], ...]
    after: tuple[int | None, ...]
    #: the checked spec it was resolved from (a cluster ships it: each replica resolves its rows)
    spec: object = None

    def width(self) -> int:
        return max(len(r) for r in self.rows)

    def keeps(self, row: int, position: int) -> bool:
        start = self.after[row]
        return position in self.rows[row] or (start is not None and position >= start)

def as_int(value) -> int | None:
    """``value`` as a Python int when it is an integer (numpy integers such as ``np.int64(3)``
    and 0-d integer tensors count; bools do not: :func:`~interp_engine.scalars.integer`), else None."""
    return integer(value)


def check_spec(positions):
    """Validate the *form* of a positions spec (before any tokens are seen); returns it, its
    ints as Python ints (numpy integers and 1-D integer arrays are accepted)."""
    if positions is None or isinstance(positions, slice):
        if isinstance(positions, slice):
            for bound in (positions.start, positions.stop, positions.step):
                if bound is not None and as_int(bound) is None:
                    raise InputError(f"positions={shown(positions)}: slice bounds must be ints or None")
            positions = slice(*(None if b is None else as_int(b) for b in
                                (positions.start, positions.stop, positions.step)))
            if positions.step == 0:
                raise InputError(f"positions={shown(positions)}: a slice step cannot be zero")
        return positions
    if isinstance(positions, str):
        if positions not in _WORDS:
            raise InputError(f"unknown positions={shown(positions)}; positions may be {_FORMS}")
        return positions
    if isinstance(positions, (torch.Tensor, np.ndarray)):
        ints = (not positions.is_floating_point() and positions.dtype != torch.bool
                and not positions.is_complex()) if isinstance(positions, torch.Tensor) else (
            np.issubdtype(positions.dtype, np.integer))
        if positions.ndim > 1 or not ints:
            raise InputError(f"positions as a tensor must be a 1-D tensor of ints, got {positions.dtype} "
                             f"of shape {tuple(positions.shape)}")
        positions = positions.tolist()
    if as_int(positions) is not None:
        return as_int(positions)
    if isinstance(positions, (list, tuple)):
        if not positions:
            raise InputError("positions=[] selects no position; pass None for all, or e.g. [-1] for the last")
        bad = [p for p in positions if as_int(p) is None]
        if bad:
            raise InputError(f"positions must be ints, got {shown(bad[0])} in {shown(list(positions))}")
        return [as_int(p) for p in positions]
    raise InputError(f"positions={shown(positions)} ({type(positions).__name__}) is not understood; positions may be {_FORMS}")


def resolve_row(spec, length: int, row: int | str = 0) -> tuple[int, ...]:
    """The prompt positions ``spec`` keeps in a row of ``length`` real tokens, sorted, once each
    (``row``: the row's index, or how an error names it)."""
    where = f"batch row {row}" if isinstance(row, int) else row
    if spec is None or spec == "prompt":
        return tuple(range(length))
    if spec == "generated":
        return ()
    if isinstance(spec, slice):
        return tuple(sorted(set(range(length)[spec])))
    wanted = [spec] if isinstance(spec, int) else spec
    out = []
    for p in wanted:
        if not -length <= p < length:
            raise InputError(
                f"positions={shown(spec)}: position {p} is out of range for {where}, which has {length} "
                f"tokens (valid: {-length}..{length - 1}; negative counts from the end of each prompt)"
            )
        out.append(p % length)
    return tuple(sorted(set(out)))


def resolve(spec, lengths: list[int], *, generating: bool = False, max_tokens: int | None = None) -> Selection | None:
    """Resolve a checked spec against the prompt ``lengths`` of a batch; None means every position.

    Raises :class:`InputError` for a position out of range in any row, and for a selection that
    keeps nothing in some row.
    """
    if spec is None:
        return None
    if spec == "generated" and not generating:
        raise InputError("positions='generated' only applies to capture_generation (and capture with max_tokens=N); "
                         "run_with_cache computes no generated positions. Use 'prompt', an int, a list or a slice")
    rows = tuple(resolve_row(spec, n, row) for row, n in enumerate(lengths))
    after = tuple((n if spec == "generated" else None) for n in lengths)
    if spec == "generated" and max_tokens == 1:
        raise InputError("positions='generated' with max_tokens=1 selects nothing: the one sampled token is never "
                         "fed back through the model. Use max_tokens >= 2, or positions=-1 for the last prompt token")
    for row, kept in enumerate(rows):
        if not kept and after[row] is None:
            raise InputError(f"positions={shown(spec)} selects no position of batch row {row} ({lengths[row]} tokens); "
                             f"positions may be {_FORMS}")
    return Selection(rows, after, spec)


def check_prompt(spec, length: int, where: str) -> None:
    """Raise unless ``spec`` keeps some position of a prompt of ``length`` tokens."""
    if spec is not None and spec != "generated" and not resolve_row(spec, length, where):
        raise InputError(f"positions={shown(spec)} selects no position of {where} ({length} tokens); "
                         f"positions may be {_FORMS}")


def width_bound(spec, max_length: int) -> int:
    """The most positions ``spec`` keeps in any prompt of at most ``max_length`` tokens."""
    if spec is None or spec == "prompt":
        return max_length
    if isinstance(spec, slice):
        return max(len(range(n)[spec]) for n in range(1, max_length + 1))
    return len(set([spec] if isinstance(spec, int) else spec))


def held_positions(selection: Selection | None, lengths: list[int], total: list[int] | None = None) -> torch.Tensor:
    """``[batch, width]``: the positions each row holds, -1 where it holds fewer than the widest.

    ``total``: each row's number of computed positions (prompt + fed generated tokens)."""
    total = total or lengths
    if selection is None:
        rows = [list(range(t)) for t in total]
    else:
        rows = [list(r) + (list(range(a, t)) if a is not None else []) for r, a, t in
                zip(selection.rows, selection.after, total)]
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def gather_positions(tensor: torch.Tensor, index: torch.Tensor, *, axis: int = 1,
                     complete: bool | None = None) -> torch.Tensor:
    """``tensor[b, index[b, i], ...]`` for ``index`` ``[batch, k]`` (-1 entries give zeros), the
    positions on ``axis`` (an address's ``query_axis``). ``complete``: whether ``index`` holds no
    -1, when the caller knows (an index already on the GPU would otherwise be read back)."""
    if axis != 1:
        return gather_positions(tensor.transpose(1, axis), index, complete=complete).transpose(1, axis)
    valid = index >= 0
    batch = torch.arange(tensor.shape[0], device=tensor.device)[:, None]
    picked = tensor[batch, index.clamp(min=0).to(tensor.device)]
    if complete if complete is not None else bool(valid.all()):
        return picked
    keep = valid.reshape(*valid.shape, *([1] * (picked.dim() - 2))).to(tensor.device)
    return torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
