"""Loading a model into this process: a name resolved to a local folder, then the chosen backend.

:func:`interp_engine.load_model` calls :func:`load_local` unless ``replicas=`` asks for a cluster;
each Ray replica calls it to load its own copy. A name is resolved without network, in this order: a local folder holding a Hugging Face
model; the embedded default ``HuggingFaceTB/SmolLM2-135M-Instruct`` (see :mod:`.embedded`); a
hub id already in the local Hugging Face cache. Anything else is a clear error: this engine
never downloads.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import embedded
from .dtypes import to_dtype
from .model import CaptureModel
from .errors import ModelNotFound

BACKENDS = ("eager", "vllm")


def resolve(name_or_path: str) -> Path:
    """The local folder that holds ``name_or_path``'s weights and tokenizer."""
    path = Path(os.path.expanduser(str(name_or_path)))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} is a folder but holds no config.json: point at a Hugging Face model folder")
        return path
    if str(name_or_path) == embedded.NAME:
        return embedded.ensure()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path), local_files_only=True, cache_dir=_hub_cache()))
    except Exception as err:  # huggingface_hub raises several types for "not cached"
        raise ModelNotFound(
            f"{name_or_path!r} is not a local folder and not in the local Hugging Face cache "
            f"({_hub_cache() or '~/.cache/huggingface/hub'}), and this engine never downloads. "
            f"Pass a folder that holds the model, download it beforehand "
            f"(huggingface-cli download {name_or_path}), or use the embedded default "
            f"load_model({embedded.NAME!r}). ({type(err).__name__})"
        ) from None


def _hub_cache() -> str | None:
    """The HF hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def load_local(name_or_path: str, backend: str = "eager", *, requires_grad: bool = False, dtype="float32",
               device: str | None = None, **backend_options) -> CaptureModel:
    """Load ``name_or_path`` on ``backend`` in this process (see :func:`interp_engine.load_model`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    path = resolve(name_or_path)
    name = str(name_or_path)
    if backend == "vllm":
        if requires_grad:
            raise ValueError("requires_grad=True is eager-only: vLLM computes no gradients. Use backend='eager'.")
        from .backends.vllm import load_vllm

        model = load_vllm(path, name, dtype=to_dtype(dtype), **backend_options)
        model.source = path
        return model
    if backend_options:
        raise TypeError(f"options {sorted(backend_options)} are not eager-backend options")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .backends.eager import EagerModel

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=to_dtype(dtype))
    if device:
        hf = hf.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = EagerModel(hf, tokenizer, name, requires_grad=requires_grad)
    model.source = path
    return model
