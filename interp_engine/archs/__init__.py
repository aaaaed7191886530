"""Per-architecture knowledge, held as data.

Each model family is one :class:`Arch`: where its decoder layers live, and for every site of
the address space which module of a layer to hook and whether to read that module's input or
its output. The capture code of every backend reads these tables; it holds no branches on the
family. A family that is not listed raises an error naming the ones that are.

The tables live in ``dense.py``, ``moe.py`` and ``streams.py`` (built from the records in
``base.py``); :data:`FAMILIES` lists them explicitly, so importing this package does no work.
A vLLM backend reads the same tables, with its own module names where vLLM's layers differ
(``vllm_sites.py``).
"""

from __future__ import annotations

from ..address import ModelInfo
from . import dense, moe, streams
from .base import LAYOUTS as LAYOUTS
from .base import Arch as Arch
from .base import Hook as Hook
from .moe import moe_layers

#: every supported family, in the order ``arch_for`` looks a model type up
FAMILIES: tuple[Arch, ...] = (*dense.ARCHS, *moe.ARCHS, *streams.ARCHS)


def arch_for(config) -> Arch:
    model_type = getattr(config, "model_type", None)
    for arch in FAMILIES:
        if model_type in arch.model_types:
            return arch
    known = sorted(t for a in FAMILIES for t in a.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported yet; supported: {', '.join(known)}")


def model_info(config, name: str) -> ModelInfo:
    """The address-relevant facts of a transformers config."""
    arch = arch_for(config)
    n_heads = config.num_attention_heads
    d_head = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    n_experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                 or getattr(config, "n_routed_experts", None) or 0)
    d_mlp = getattr(config, "intermediate_size", 0) or 0
    return ModelInfo(
        name=name,
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        d_head=d_head,
        d_mlp=max(d_mlp) if isinstance(d_mlp, (list, tuple)) else d_mlp,
        d_vocab=config.vocab_size,
        n_ctx=getattr(config, "max_position_embeddings", 0) or 0,
        n_experts=n_experts,
        top_k=getattr(config, "num_experts_per_tok", 0) or 0 if n_experts else 0,
        family=arch.family,
        n_streams=getattr(config, arch.streams_config) if arch.streams_config else 1,
        moe_layers=moe_layers(config) if n_experts else (),
        sites=frozenset(arch.sites) | {"logits"},
    )
