"""One number, however a caller holds it: a Python int or float, a numpy scalar
(``np.float32(0.5)``, ``np.int64(3)``), a 0-d numpy array, or a 0-d torch tensor
(``torch.tensor(2.0)``, ``x.norm()``, ``t.argmax()``).

Every place that takes a number (an edit's scale or factor, a generation option, a layer, a
position, a feature id, a dictionary option) reads it through :func:`real` or :func:`integer`,
so each accepts the same forms and refuses the same ones: a bool is not a number (``True`` is
an ``int`` to Python but almost always a mistake here), nor is a complex one, nor a tensor
with more than one element.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch


def _scalar(value):
    """``value`` as a Python (or numpy) scalar when it is a 0-d tensor or array; else itself."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or value.device.type == "meta":
            return None
        return value.item()
    if isinstance(value, np.ndarray):
        return value[()] if value.ndim == 0 else None
    return value


def real(value) -> float | None:
    """``value`` as a Python float when it is a real number (see the module docstring), else
    None. An integer too large for a float is ``±inf`` (so a finiteness check refuses it)."""
    value = _scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def integer(value) -> int | None:
    """``value`` as a Python int when it is an integer (see the module docstring; a float such
    as ``3.0`` is not), else None."""
    value = _scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        return None
    return int(value)
