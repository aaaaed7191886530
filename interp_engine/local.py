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
from .capabilities import LOADERS, backend_class
from .dtypes import to_dtype
from .model import CaptureModel
from .devices import check_device
from .errors import ModelNotFound

#: the ``backend=`` names (see :data:`.capabilities.LOADERS`)
BACKENDS = tuple(LOADERS)


def find_model(name_or_path: str) -> Path:
    """The local folder that holds ``name_or_path``'s weights and tokenizer."""
    path = Path(os.path.expanduser(str(name_or_path)))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} is a folder but holds no config.json: point at a Hugging Face model folder")
        return path
    if _is_path(str(name_or_path)):
        missing = next((p for p in [path, *path.parents] if p.exists()), None)
        where = f"(the nearest folder that exists is {missing})" if missing is not None else ""
        raise ModelNotFound(f"{str(name_or_path)!r}: no such folder {where}; pass the folder that holds the model's "
                            f"config.json and weights (a hub id is 'org/name')")
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


def _is_path(name: str) -> bool:
    """Whether ``name`` is written as a file path rather than a hub id (``org/name``)."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or "\\" in name


def _hub_cache() -> str | None:
    """The HF hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def load_local(name_or_path: str, backend: str = "eager", *, requires_grad: bool = False, dtype="float32",
               device: str | None = None, **backend_options) -> CaptureModel:
    """Load ``name_or_path`` on ``backend`` in this process (see :func:`interp_engine.load_model`):
    the backend's class is looked up in :data:`~.capabilities.LOADERS` and loads it."""
    cls = backend_class(backend)
    if device is not None and cls.capabilities.takes_device:
        check_device(device)
    path = find_model(name_or_path)
    if requires_grad and not cls.capabilities.gradients:
        with_grad = [n for n in BACKENDS if backend_class(n).capabilities.gradients]
        raise ValueError(f"requires_grad=True is {'/'.join(with_grad)}-only: {cls.capabilities.label} computes no "
                         f"gradients. Use backend={with_grad[0]!r}.")
    model = cls.load(path, str(name_or_path), dtype=to_dtype(dtype), device=device, requires_grad=requires_grad,
                     **backend_options)
    model.source = path
    return model

