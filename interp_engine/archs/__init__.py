"""Per-architecture knowledge, held as data.

Each model family is one :class:`Arch`: where its decoder layers live, and for every site of
the address space which module of a layer to hook and whether to read that module's input or
its output. The capture code of every backend reads these tables; it holds no branches on the
family. A family that is not listed raises an error naming the ones that are.

The tables live in ``dense.py``, ``moe.py`` and ``streams.py`` (built from the records in
``base.py``); :data:`FAMILIES` lists them explicitly, so importing this package does no work.
Each family's ``Arch`` also holds the vLLM backend's reads (``Arch.vllm``, built in
``vllm_reads.py``): vLLM's layers fuse the residual add, so most of its reads differ. A family
whose layers have Llama's module names is served on both backends by one ``model_type`` entry.
"""

from __future__ import annotations

from ..address import SITES, ModelInfo
from ..sites import MODEL_LEVEL
from . import dense, moe, streams
from .base import LAYOUTS as LAYOUTS
from .base import LOGITS as LOGITS
from .base import Arch as Arch
from .base import Group as Group
from .base import Hook as Hook
from .base import group_sites as group_sites
from .moe import moe_layers

#: every supported family, in the order ``arch_for`` looks a model type up
FAMILIES: tuple[Arch, ...] = (*dense.ARCHS, *moe.ARCHS, *streams.ARCHS)


def arch_for(config, families: tuple[Arch, ...] = FAMILIES) -> Arch:
    """The family record of a transformers ``config``: the first of ``families`` that fits it."""
    model_type = getattr(config, "model_type", None)
    for arch in families:
        if arch.fits(config):
            return arch
    if any(model_type in a.model_types for a in families):
        raise ValueError(f"this {model_type!r} config fits none of its family records "
                         f"({', '.join(a.family for a in families if model_type in a.model_types)}): "
                         f"its variant is not supported yet; use a supported checkpoint of the family")
    known = sorted(t for a in families for t in a.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported yet; supported: {', '.join(known)}")


def vllm_sites(family: str) -> dict[str, Hook]:
    """The vLLM backend's reads for ``family`` (an error naming the served families if none)."""
    arch = next((a for a in FAMILIES if a.family == family), None)
    if arch is None or not arch.vllm:
        served = [a.family for a in FAMILIES if a.vllm]
        raise ValueError(
            f"the vLLM backend has no site table for family {family!r}; known: {', '.join(served)}. "
            f"Use backend='eager', or add vllm= reads to the family's Arch in interp_engine/archs/"
        )
    return arch.vllm


#: sites read under another site's hook on a single-stream model
SAME_AS = {"resid_streams": "resid_post"}


def unserved_sites(table: dict[str, Hook]) -> frozenset[str]:
    """The per-layer sites a backend whose reads are ``table`` cannot serve (the one rule for
    every backend; a backend adds what it finds unreadable at run time)."""
    return frozenset(s for s in SITES if s not in MODEL_LEVEL and s not in table and SAME_AS.get(s) not in table)


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
        sites=frozenset(arch.sites) | MODEL_LEVEL,
    )
