"""Comparison helpers shared by the backend-parity tests."""

from __future__ import annotations

import torch

#: relative tolerance of vLLM against the eager backend (fp32): max error / max magnitude
REL = 1e-4


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = REL) -> None:
    """Same shape, and the largest absolute error at most ``rel`` times the largest magnitude."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max())
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} > {rel} * {scale:.3g}"
