"""When two captures are "equal": the engine's equality contract, stated once.

Floating-point sums depend on their order, and the order depends on the computation: the shape
of the batch (a padded batch row vs the same prompt alone take different matmul kernels), the
number of torch threads (each splits a reduction differently), the kernels the CPU or GPU picks,
and the backend (HF eager vs vLLM's fused kernels). So there are two kinds of equality:

- **Bit for bit** (``torch.equal``) when the computation is the same: same backend, same weights
  and dtype, same batch shape, same torch thread count, same kind of device. A cluster replica
  given a shard equals the local model run on that same shard with the same threads; a cache
  saved and loaded equals itself.
- **Within a relative tolerance** when the same values are computed differently: a padded batch
  row vs the prompt alone, 1 vs N threads, a cluster (which splits batches and runs with its own
  threads) vs a local call, vLLM vs eager. The error is measured against the tensor's scale —
  ``max|got - want| / max|want|`` — because residual-stream values of real models reach 1e4
  (SmolLM2), where an absolute bound is meaningless.

The tolerances (fp32; measured on SmolLM2 and the tiny test models, ~1e-7–1e-6 in practice):

========================================  =========
same backend, different computation         ``1e-5``  (:data:`SAME_BACKEND`)
vLLM vs eager                               ``1e-4``  (:data:`CROSS_BACKEND`)
========================================  =========

Which kernels a machine picks differs between CPUs, so only these two statements hold on every
machine; anything stronger (bitwise equality across batch shapes or thread counts) may happen to
hold on one machine and fail on the next.
"""

from __future__ import annotations

import torch

#: relative tolerance for the same backend computing the same values differently (fp32)
SAME_BACKEND = 1e-5
#: relative tolerance between backends (vLLM vs eager, fp32)
CROSS_BACKEND = 1e-4


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` (0 when both are all zeros); shapes must agree."""
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    if err == 0.0:
        return 0.0
    return err / scale if scale else float("inf")


def close(got: torch.Tensor, want: torch.Tensor, rel: float = SAME_BACKEND) -> bool:
    """Whether ``got`` equals ``want`` within ``rel`` relative error (see the module docstring)."""
    return got.shape == want.shape and relative_error(got, want) <= rel
