"""``load_model``: from a name to a :class:`CaptureModel` on the chosen backend, in this process
(:mod:`.local`) or served by replicas on a Ray cluster (:mod:`.cluster`).

A name is resolved without network, in this order: a local folder holding a Hugging Face
model; the embedded default ``HuggingFaceTB/SmolLM2-135M-Instruct`` (see :mod:`.embedded`); a
hub id already in the local Hugging Face cache. Anything else is a clear error: this engine
never downloads.
"""

from __future__ import annotations

from . import embedded
from .capabilities import check_backend
from .in_memory import is_module, wrap_module
from .local import BACKENDS, load_local, find_model
from .model import CaptureModel

__all__ = ["BACKENDS", "load_model", "find_model"]


def load_model(
    name_or_path: str = embedded.NAME,
    backend: str = "eager",
    *,
    requires_grad: bool = False,
    dtype="float32",
    device: str | None = None,
    replicas: int | None = None,
    **backend_options,
) -> CaptureModel:
    """Load a model for capture.

    ``backend="eager"`` (HF transformers: batches, gradients, every site) or ``"vllm"`` (a vLLM
    engine: fast prefill and generation, ``tensor_parallel_size``, ``max_model_len``).
    ``replicas=N`` serves the model from N replicas on a Ray cluster with the same calls.
    A transformers model already in memory is wrapped as it is (eager): ``load_model(hf_model,
    tokenizer=tokenizer)`` (see :mod:`.in_memory`).
    """
    check_backend(backend)  # by name: a cluster load never imports the backend on the driver
    if is_module(name_or_path):
        return wrap_module(name_or_path, backend, requires_grad=requires_grad, replicas=replicas, device=device,
                           **backend_options)
    if replicas is not None:
        from .cluster.model import load_cluster_model

        return load_cluster_model(name_or_path, backend=backend, replicas=replicas, requires_grad=requires_grad,
                                  dtype=dtype, device=device, **backend_options)
    return load_local(name_or_path, backend, requires_grad=requires_grad, dtype=dtype, device=device,
                      **backend_options)
