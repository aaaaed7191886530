"""A norm's output before its gain: TransformerLens's ``hook_normalized``.

An RMS norm computes ``gain * x / rms(x)`` and a LayerNorm ``gain * (x - mean) / std + bias`` in
one call, so no module outputs the tensor between the division and the gain — the tensor that
TransformerLens names ``ln1`` / ``ln2`` / ``ln_final.hook_normalized`` and that SAEs and
transcoders trained through TransformerLens read (Gemma Scope's, circuit-tracer's). It is
recomputed here from the norm's input with the norm's own epsilon, in float32 as the Hugging Face
norms compute it, and cast back to the input's dtype. Whether a norm centres is what the module
is (``nn.LayerNorm``), not which family it belongs to.
"""

from __future__ import annotations

import torch

from interp_engine.errors import InternalError


def pre_gain(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm``'s normalisation of ``x`` without its gain (and bias): ``x / rms(x)`` for an RMS
    norm, ``(x - mean) / std`` for a LayerNorm."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, (int, float)):
        raise InternalError(f"[Internal] {type(norm).__name__} has no variance_epsilon / eps: not a norm this "
                            f"engine knows how to split before its gain")
    h = x.float()
    if isinstance(norm, torch.nn.LayerNorm):
        h = h - h.mean(-1, keepdim=True)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
