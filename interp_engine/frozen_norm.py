"""The final norm frozen at a residual: the affine map that logit attribution puts components through.

A final norm computes ``gain * center(x) / s(x) + bias`` per position: an RMS norm (Llama, Gemma)
has no centring and no bias; a LayerNorm (GPT-2, GPT-NeoX) subtracts each position's mean and adds
a bias. With ``s(x)`` frozen at the final residual the map is affine, ``x -> center(x) * scale +
bias``, so each component of a decomposition can be put through its linear part and the parts
sum to ``final_norm(resid) - bias``. Which kind of norm a model has is measured on the norm
itself (it answers the same to ``x`` and ``x + 1`` exactly when it centres; its bias is its
answer to zero), so this holds for any family's norm without naming it.
"""

from __future__ import annotations

import dataclasses

import torch

from .compare import relative_error


@dataclasses.dataclass(frozen=True)
class FrozenNorm:
    """``final_norm(resid) == center(resid) * scale + bias`` (``center``: minus each position's
    mean where ``centers``, else the identity)."""

    scale: torch.Tensor  # [..., d_model]
    centers: bool
    bias: torch.Tensor  # [d_model]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The linear part applied to ``x`` (a component of the residual): ``center(x) * scale``."""
        x = x.to(self.scale.device)
        return center(x, self.centers) * self.scale


def center(x: torch.Tensor, centers: bool) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True) if centers else x


def freeze(norm, resid: torch.Tensor) -> FrozenNorm:
    """``norm`` (a ``[..., d_model] -> [..., d_model]`` callable) frozen at ``resid``."""
    with torch.no_grad():
        d = resid.shape[-1]
        normed = norm(resid)
        device, dtype = normed.device, normed.dtype
        bias = norm(torch.zeros(d, dtype=resid.dtype)).to(device)
        probe = torch.linspace(-1.0, 1.0, d, dtype=resid.dtype)
        centers = relative_error(norm(probe + 3.0), norm(probe)) < 1e-3
        # each feature's gain (up to one shared factor) from a probe whose entries are all +-1
        signs = torch.ones(d, dtype=resid.dtype)
        signs[1::2] = -1.0
        gain = (norm(signs).to(device) - bias) / center(signs, centers).to(device, dtype)
        shaped = center(resid.to(device, dtype), centers) * gain
        # the per-position factor, recovered by projection (exact: normed - bias is shaped times it)
        factor = ((normed - bias) * shaped).sum(-1, keepdim=True) / (shaped * shaped).sum(-1, keepdim=True).clamp_min(1e-30)
        return FrozenNorm(gain * factor, centers, bias)
