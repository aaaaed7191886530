"""The device the eager tests put their models on: ``pytest --device cuda`` (default ``cpu``).

The same test modules run on either device (bench/gpu/check.sh runs them on a GPU). Users pass
token ids on the CPU and get captures on the model's device, so the tests do the same; an oracle
that calls the Hugging Face model directly moves its inputs with :func:`on`.
Modules in :data:`MODULES` are written for any device; under ``--device cuda`` every other test
module is skipped (they need vLLM or Ray, which the GPU machine does not have, or run only on the
CPU by design).
"""

from __future__ import annotations

from pathlib import Path

import torch

#: set once by conftest.pytest_configure from ``--device``
DEVICE = "cpu"

#: the test modules that run unchanged on any device
MODULES = ("test_eager", "test_edits", "test_generation_eager", "test_positions", "test_analysis",
           "test_lens", "test_moe", "test_cache", "test_address",
           "test_families", "test_family_gemma", "test_family_olmo", "test_family_gpt_oss", "test_must_change")


def paths(root: Path = Path(__file__).resolve().parents[1]) -> list[str]:
    """The file of each module in :data:`MODULES`, relative to ``root`` (found under tests/
    wherever it lives, so a module that moves folders stays in the device run)."""
    found = []
    for name in MODULES:
        files = sorted((root / "tests").rglob(f"{name}.py"))
        if len(files) != 1:
            raise SystemExit(f"tests/devices.py MODULES names {name!r}, found {len(files)} files for it under "
                             f"tests/: {[str(f) for f in files]}; rename or remove the entry")
        found.append(str(files[0].relative_to(root)))
    return found


def on(model, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on ``model``'s device (an oracle's input to ``model.hf``)."""
    return tensor.to(model.device)


def load_kwargs() -> dict:
    """Extra ``load_model`` arguments for an eager test model: the device, where it is not the CPU."""
    return {} if DEVICE == "cpu" else {"device": DEVICE}
