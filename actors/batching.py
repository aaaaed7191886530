"""Splitting a padded batch into rows and joining rows back into one padded batch.

A one-prompt backend (vLLM) runs each row at its true length; a cluster splits a batch over
replicas. Both come back to the engine's padded form: tokens right-padded with ``PAD_ID``,
every activation zero at padded positions, exactly what a batched local model returns.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from interp_engine.address import Address
from interp_engine.cache import Cache
from interp_engine.model import CaptureModel
from interp_engine.tokens import PAD_ID


def chunk_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``min(parts, rows)`` contiguous, near-equal row chunks: how a batched
    backend's padded batch is cut over ``parts`` replicas."""
    n = min(parts, rows)
    bounds = np.linspace(0, rows, n + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def position_dims(address: Address) -> tuple[int, ...]:
    """Which axes of a ``[batch, ...]`` tensor run over positions."""
    return (2, 3) if address.name == "pattern" else (1,)


def pad_positions(tensor: torch.Tensor, address: Address, width: int) -> torch.Tensor:
    """Zero-pad the position axes of ``tensor`` up to ``width``."""
    pad: list[int] = []
    for dim in reversed(range(1, tensor.dim())):
        pad += [0, width - tensor.shape[dim]] if dim in position_dims(address) else [0, 0]
    return F.pad(tensor, pad) if any(pad) else tensor


def pad_tokens(tokens: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(tokens, (0, width - tokens.shape[1]), value=PAD_ID)


def join_rows(parts: list[dict[Address, torch.Tensor]], tokens: list[torch.Tensor],
              width: int | None = None) -> tuple[dict[Address, torch.Tensor], torch.Tensor]:
    """Concatenate per-row (or per-chunk) results along the batch, padded to one width."""
    width = width or max(t.shape[1] for t in tokens)
    joined = {a: torch.cat([pad_positions(p[a], a, width) for p in parts]) for a in parts[0]}
    return joined, torch.cat([pad_tokens(t, width) for t in tokens])


def run_padded(model: CaptureModel, tokens: torch.Tensor, addresses: list[Address]) -> Cache:
    """``model.run_with_cache`` on a padded batch, one row at a time where the model takes one
    prompt per call; the result is the padded batch a batched model would return."""
    if model.batched or tokens.shape[0] == 1 and bool((tokens >= 0).all()):
        return model.run_with_cache(tokens, addresses)
    rows = [row[row >= 0][None] for row in tokens]
    parts = [model.run_with_cache(row, addresses).to_dict() for row in rows]
    joined, padded = join_rows(parts, rows, tokens.shape[1])
    return Cache(joined, padded, None, model.name, model.backend)
