"""Analysis helpers: functions of a cache (and the model's weights), not points of capture."""

from __future__ import annotations

import torch

from .cache import Cache


def head_contributions(model, cache: Cache, layer: int) -> torch.Tensor:
    """What each attention head writes into the residual at ``layer``: ``[batch, pos, n_heads, d_model]``.

    ``z.layer`` through each head's slice of the output projection. Summed over heads (plus the
    projection's bias, if any) it is the output projection's output. This is ``n_heads`` times
    the size of ``z``, so it is computed on demand rather than captured.
    """
    z = cache.get("z", layer)  # [b, p, h, d_head]
    weight = model.o_proj_weight(layer)  # [d_model, h * d_head]
    w = weight.reshape(weight.shape[0], model.n_heads, model.d_head).to(z.dtype)
    return torch.einsum("bphd,mhd->bphm", z, w.to(z.device))
