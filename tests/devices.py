"""The device the eager tests put their models on: ``pytest --device cuda`` (default ``cpu``).

The same test modules run on either device (bench/gpu/check.sh runs them on a GPU). Users pass
token ids on the CPU and get captures on the model's device, so the tests do the same; an oracle
that calls the Hugging Face model directly moves its inputs with :func:`on`.
Modules in :data:`MODULES` are written for any device; under ``--device cuda`` every other test
module is skipped (they need vLLM or Ray, which the GPU machine does not have, or run only on the
CPU by design).
"""

from __future__ import annotations

import torch

#: set once by conftest.pytest_configure from ``--device``
DEVICE = "cpu"

#: the test modules that run unchanged on any device
MODULES = ("test_eager", "test_edits", "test_generation_eager", "test_positions", "test_analysis",
           "test_lens", "test_moe", "test_cache", "test_address")


def on(model, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on ``model``'s device (an oracle's input to ``model.hf``)."""
    return tensor.to(model.device)


def load_kwargs() -> dict:
    """Extra ``load_model`` arguments for an eager test model: the device, where it is not the CPU."""
    return {} if DEVICE == "cpu" else {"device": DEVICE}
