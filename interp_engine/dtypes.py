"""Floating-point dtypes by name, and bfloat16 carried where it has no type of its own.

Models, datasets and the wire to replicas name dtypes the same way (``"float32"``,
``"bfloat16"``, ``"float16"``; ``load_model`` also takes ``fp32`` / ``bf16`` / ``fp16``).
numpy has no bfloat16: a bf16 tensor crosses numpy (Ray's object store, Parquet format 1) as its
raw 16-bit pattern in an int16 array and is viewed back, so nothing is rounded (:class:`interp_engine.wire.Packed` is a
tensor in that form, what crosses processes).
"""

from __future__ import annotations


import torch

#: the floating-point dtypes activations and weights are held in
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` (or ``"torch.bfloat16"``) -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def to_dtype(dtype) -> torch.dtype:
    """A torch dtype from a torch dtype, a name in :data:`DTYPES` or an alias (``bf16``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join([*DTYPES, *_ALIASES])} or a torch.dtype")
    return DTYPES[name]


def bf16_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A bfloat16 tensor's raw 16-bit patterns, as int16 (which numpy holds)."""
    return tensor.view(torch.int16)


def as_bfloat16(tensor: torch.Tensor) -> torch.Tensor:
    """A bfloat16 tensor back from how it was stored: 16-bit patterns (int16 / uint16) are viewed,
    float values cast (exact when they came from bfloat16)."""
    if tensor.dtype in (torch.int16, torch.uint16):
        return tensor.view(torch.int16).view(torch.bfloat16)
    return tensor.to(torch.bfloat16)
