"""The numbers an edit writes: finite, real, within float32, checked before anything runs.

A NaN or inf written into an activation spreads through every later position and layer of the
request (and, on vLLM, into its KV cache), so every backend refuses it up front with the edit,
the address and the fix; numpy scalars count as numbers. :mod:`.edits` calls these while it plans
an edit against a model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import InputError, shown
from .scalars import real

#: the largest float32; an edit's numbers must fit
FLOAT32_MAX = torch.finfo(torch.float32).max
#: why an edit may only write finite numbers (the end of every such refusal)
_WHY_FINITE = ("a NaN or inf spreads through every later position and layer of the request; pass finite "
               "numbers (e.g. torch.nan_to_num(x), or check the division or norm that produced it)")


def number(address, name, value) -> float:
    """A finite real number (numpy scalars such as ``np.float32(0.5)`` and 0-d tensors such as
    ``torch.tensor(2.0)`` count: :func:`~interp_engine.scalars.real`) as a float."""
    number = real(value)
    if number is None:
        raise InputError(f"edit on {address}: {name} must be a number (a float, a numpy scalar or a 0-d tensor), "
                         f"got {shown(value)}")
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        text = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:12]}... ({len(repr(value))} digits)"
        raise InputError(f"edit on {address}: {name} must be a finite number within float32 (|x| <= 3.4e38), "
                         f"got {text}: {_WHY_FINITE}")
    return number


def tensor(address, name, value) -> torch.Tensor:
    """``value`` as a finite, real float32 tensor on the CPU (refused otherwise, with the fix)."""
    if not isinstance(value, (torch.Tensor, np.ndarray)) and real(value) is not None:
        value = number(address, name, value)
    try:
        tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InputError(f"edit on {address}: {name} must be a tensor or a number, got {type(value).__name__}") from None
    if tensor.device.type == "meta":
        raise InputError(f"edit on {address}: {name} is on the meta device (a shape without values); pass a "
                         f"tensor that holds numbers, e.g. one made with device='cpu'")
    if tensor.is_complex():
        raise InputError(f"edit on {address}: {name} is complex; activations are real numbers: pass a real "
                         f"tensor (e.g. value.real, or value.abs() if you meant the magnitude)")
    if tensor.dtype == torch.bool:
        raise InputError(f"edit on {address}: {name} is a bool tensor; pass numbers (e.g. mask.float())")
    if tensor.is_sparse:
        tensor = tensor.to_dense()
    _check_finite(address, name, tensor)
    out = tensor.float().cpu()
    if tensor.is_floating_point() and tensor.dtype != torch.float32:
        _check_finite(address, name, out, " once converted to float32 (its range ends near ±3.4e38)")
    return out


def _check_finite(address, name, tensor: torch.Tensor, how: str = "") -> None:
    if not tensor.is_floating_point():
        return
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        value = tensor[tuple(where)].item()
        at = f" at index {where}" if where else ""
        raise InputError(f"edit on {address}: {name} holds {value}{at}{how}; {_WHY_FINITE}")


def check_add(address, vector: torch.Tensor, scale: float, norm_relative: bool) -> None:
    """What an ``Add`` writes must be finite too: ``scale * vector`` (or, norm-relative, the
    unit vector, which needs a finite nonzero norm)."""
    if norm_relative:
        norm = float(vector.norm())
        if not norm > 0:
            raise InputError(f"edit on {address}: norm_relative=True needs a vector with a nonzero norm (it adds "
                             f"scale * |x| in the vector's direction); pass a nonzero vector")
        if not math.isfinite(norm):
            raise InputError(f"edit on {address}: the vector's norm overflows float32, so its direction is lost; "
                             f"divide it by its largest value first (norm_relative=True uses only its direction)")
    elif not bool(torch.isfinite(scale * vector).all()):
        raise InputError(f"edit on {address}: Add's scale * vector overflows float32 (scale={scale:g}, largest "
                         f"|vector| {float(vector.abs().max()):g}); lower the scale or the vector: an edit must "
                         f"write finite numbers")
