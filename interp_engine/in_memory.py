"""Models already in memory: ``load_model(hf_model, tokenizer=...)``.

A researcher who has built, fine-tuned or patched a Hugging Face ``PreTrainedModel`` in their
notebook can capture from it without saving it first. The module is wrapped as it is — its
weights, dtype and device are the ones it has (``model.hf`` is that same object) — on a backend
whose class can take a module (:meth:`~.backends.eager.model.EagerModel.from_module`; the eager
backend). A vLLM engine and cluster replicas load their own weights from a folder, so for those
the error says to save the module first.
"""

from __future__ import annotations

from .capabilities import LOADERS, backend_class
from .errors import InputError
from .model import CaptureModel


def is_module(obj) -> bool:
    """Whether ``obj`` is a model object (a ``torch.nn.Module``) rather than a name or a path."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(obj, torch.nn.Module)


def wrap_module(hf_model, backend: str = "eager", *, tokenizer=None, requires_grad: bool = False,
                replicas=None, device=None, **options) -> CaptureModel:
    """Capture from the in-memory ``hf_model`` (a transformers ``PreTrainedModel``) with ``tokenizer``."""
    takers = [n for n in LOADERS if hasattr(backend_class(n), "from_module")]
    save = ("save it first (hf_model.save_pretrained(folder); tokenizer.save_pretrained(folder)) and "
            "load_model(folder, ...)")
    if replicas is not None:
        raise InputError(f"an in-memory model cannot be sent to cluster replicas (each loads its own copy from a "
                         f"folder): {save}")
    cls = backend_class(backend)
    if not hasattr(cls, "from_module"):
        raise InputError(f"the {backend} backend loads its weights itself from a folder, so it cannot wrap a model "
                         f"object; {save}, or use backend={takers[0]!r}")
    if options:
        raise InputError(f"options {sorted(options)} do not apply to a model already in memory; it is used as it "
                         f"is (its dtype and device): cast or move it first (hf_model.to(...))")
    if device is not None:
        raise InputError(f"device={device!r}: a model already in memory is used where it is; move it first "
                         f"(hf_model.to({device!r})), then load_model(hf_model, tokenizer=...)")
    if not hasattr(hf_model, "config") or not hasattr(hf_model, "generate"):
        raise InputError(f"load_model takes a name, a folder or a transformers causal LM (a PreTrainedModel with "
                         f".config), got a {type(hf_model).__name__}")
    if tokenizer is None:
        tokenizer = _tokenizer_of(hf_model)
    name = getattr(hf_model.config, "name_or_path", "") or type(hf_model).__name__
    return cls.from_module(hf_model, tokenizer, str(name), requires_grad=requires_grad)


def _tokenizer_of(hf_model):
    """The tokenizer saved beside the model's weights, where it came from a local folder."""
    from pathlib import Path

    source = getattr(hf_model.config, "name_or_path", "")
    if source and Path(source).is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            pass
    raise InputError("a model already in memory needs its tokenizer: load_model(hf_model, tokenizer=tokenizer) "
                     "(e.g. AutoTokenizer.from_pretrained(the model's folder))")
