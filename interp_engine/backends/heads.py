"""Per-head sites, and their shape.

Attention computes ``z`` / ``q`` as ``[..., n_heads * d_head]`` and ``k`` / ``v`` as
``[..., n_kv_heads * d_head]``, one contiguous block of features per head; the address space
serves them as ``[..., heads, d_head]``. Every backend turns one into the other here.
"""

from __future__ import annotations

import torch

from ..points import ModelInfo

#: per-head sites -> the ModelInfo field that counts their heads
HEAD_SITES = {"z": "n_heads", "q": "n_heads", "k": "n_kv_heads", "v": "n_kv_heads"}


def split_heads(name: str, tensor: torch.Tensor, info: ModelInfo) -> torch.Tensor:
    """``[..., heads * d_head]`` -> ``[..., heads, d_head]`` for a per-head site ``name``; any
    other site's tensor unchanged."""
    field = HEAD_SITES.get(name)
    if field is None:
        return tensor
    width = (info.d_head_qk or info.d_head) if name in ("q", "k") else info.d_head
    return tensor.unflatten(-1, (getattr(info, field), width))
