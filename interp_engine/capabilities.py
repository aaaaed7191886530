"""What a backend can do, as data: the core reads these fields and never asks a backend's name.

Each backend class declares one :class:`Capabilities` (``EagerModel.capabilities``,
``VllmModel.capabilities``); a loaded model narrows it to the sites its family and engine cannot
read (``unserved``), and a cluster model takes its replicas'. Address checks, edit checks and the
loader all decide from these fields, so a new backend (or a front end that forwards to one) is a
new declaration, not an edit of every place that used to test ``backend == "..."``.

The backends themselves are found through :data:`LOADERS`, a table from the name users pass as
``backend=`` to the class that implements it, imported on first use (as vLLM's model registry
maps an architecture name to its module).
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """One backend's abilities. ``name`` is what users pass as ``backend=`` (and what messages
    and caches show); ``label`` is how prose names the engine behind it."""

    name: str
    label: str = ""
    #: a call may carry a padded batch of several prompts (else one prompt per call)
    batched: bool = True
    #: the attention probabilities are formed (fused attention kernels never do)
    forms_pattern: bool = True
    #: ``requires_grad=True`` works: activations keep their autograd graph
    gradients: bool = False
    #: the sites an edit may write (the model's family must serve them too)
    writable: frozenset[str] = frozenset()
    #: a Python function ``fn(tensor, address)`` is an edit (else edits are data only)
    function_edits: bool = False
    #: the loader places the weights on ``device=`` itself (else the engine picks its device)
    takes_device: bool = True
    #: sites this model cannot read exactly (they get a clear error instead)
    unserved: frozenset[str] = frozenset()
    #: sparse dictionaries (``saes=``) run where this backend makes the activations
    features: bool = False
    #: ``(site, why)`` for unserved sites whose refusal has a reason to give
    reasons: tuple[tuple[str, str], ...] = ()

    def serving(self, unserved, reasons: dict[str, str] | None = None) -> "Capabilities":
        """These capabilities for a model that cannot read the sites ``unserved`` (``reasons``:
        why, for some of them)."""
        unserved = frozenset(unserved)
        why = {**dict(self.reasons), **(reasons or {})}
        return dataclasses.replace(self, unserved=unserved,
                                   reasons=tuple(sorted((s, w) for s, w in why.items() if s in unserved)))


#: ``backend=`` name -> ``"module:Class"`` of the :class:`~interp_engine.model.CaptureModel`
#: subclass that implements it; the class has ``capabilities`` and a ``load`` classmethod
LOADERS: dict[str, str] = {
    "eager": "interp_engine.backends.eager.model:EagerModel",
    "vllm": "interp_engine.backends.vllm.model:VllmModel",
}


def check_backend(name: str) -> None:
    """A ``ValueError`` that lists the registered backends unless ``name`` is one (nothing imported)."""
    if not isinstance(name, str) or name not in LOADERS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(LOADERS)}")


def backend_class(name: str):
    """The model class registered as ``backend=name`` (imported now); an unknown name is a
    ``ValueError`` that lists the registered ones."""
    check_backend(name)
    module, cls = LOADERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
