"""Per-architecture knowledge, held as data.

Each model family is one :class:`Arch`: where its decoder layers live, and for every site of
the address space which module of a layer to hook and whether to read that module's input or
its output. The capture code of every backend reads these tables; it holds no branches on the
family. A family that is not listed raises an error naming the ones that are.

The tables live in ``dense.py``, ``gpt.py`` (GPT-2, GPT-NeoX), ``normed.py`` (Gemma 1 / 3, OLMo 2 / 3),
``moe.py``, ``gpt_oss.py``, ``mla.py`` (DeepSeek-V3), ``hybrid.py`` (Qwen3.5, Qwen3-Next) and
``streams.py`` (built from the records in
``base.py``); :data:`FAMILIES` lists them explicitly, so importing this package does no work.
Each family's ``Arch`` also holds the vLLM backend's reads (``Arch.vllm``, built in
``vllm_reads.py``): vLLM's layers fuse the residual add, so most of its reads differ. A family
whose layers have Llama's module names is served on both backends by one ``model_type`` entry.
"""

from __future__ import annotations

from ..address import SITES
from ..points import ModelInfo
from ..sites import MODEL_LEVEL
from . import dense, gpt, gpt_oss, hybrid, mla, moe, normed, streams
from .base import LAYOUTS as LAYOUTS
from .base import LOGITS as LOGITS
from .base import ONE as ONE
from .base import Arch as Arch
from .base import Group as Group
from .base import Hook as Hook
from .base import group_sites as group_sites
from .moe import moe_layers

#: every supported family, in the order ``arch_for`` looks a model type up
FAMILIES: tuple[Arch, ...] = (*dense.ARCHS, *gpt.ARCHS, *normed.ARCHS, *moe.ARCHS, *gpt_oss.ARCHS, *mla.ARCHS,
                               *hybrid.ARCHS, *streams.ARCHS)


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


def has_record(config, families: tuple[Arch, ...] = FAMILIES) -> bool:
    """Whether some family record names this config's ``model_type`` (a known family always takes
    its record; the generic path, :mod:`.generic`, is for the others)."""
    return any(getattr(config, "model_type", None) in a.model_types for a in families)


def record_for_model(hf_model) -> Arch:
    """The family record of a loaded Hugging Face model: its family's where its ``model_type`` has
    one (an error where its variant fits none), else one found and proven on the model itself
    (:func:`.generic.discover`)."""
    if has_record(hf_model.config):
        return arch_for(hf_model.config)
    from .generic import discover

    return discover(hf_model)


def describe(arch: Arch, model_type: str) -> str:
    """One line: which path a model of ``model_type`` took (its family's record, or the generic
    path) and what it serves."""
    served = ", ".join([*(s for s in SITES if s in arch.sites and s != "resid_streams"), LOGITS])
    if not arch.generic:
        return f"model_type {model_type!r} takes the family record {arch.family!r}, which serves {served}"
    return (f"no family record for model_type {model_type!r}: the generic path serves {served} "
            f"(refused: {', '.join(s for s in SITES if s in arch.refused)})")


def vllm_sites(family: str) -> dict[str, Hook]:
    """The vLLM backend's reads for ``family`` (an error naming the served families if none)."""
    arch = next((a for a in FAMILIES if a.family == family), None)
    if arch is not None and arch.vllm_unsupported:
        raise ValueError(f"the vLLM backend does not serve {family!r} models: {arch.vllm_unsupported}. "
                         f"Use backend='eager' (every site it serves: docs/MOE.md, README 'Models')")
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


def model_info(config, name: str, arch: Arch | None = None) -> ModelInfo:
    """The address-relevant facts of a transformers config (``arch``: its family record, found
    from the config where not given)."""
    arch = arch or arch_for(config)
    n_heads = config.num_attention_heads
    dims = arch.dims(config)
    n_experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                 or getattr(config, "n_routed_experts", None) or 0)
    return ModelInfo(
        name=name,
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=dims["n_kv_heads"],
        d_head=dims["d_head"],
        d_mlp=dims["d_mlp"],
        d_vocab=config.vocab_size,
        n_ctx=getattr(config, "max_position_embeddings", 0) or 0,
        n_experts=n_experts,
        top_k=getattr(config, "num_experts_per_tok", 0) or 0 if n_experts else 0,
        family=arch.family,
        n_streams=getattr(config, arch.streams_config) if arch.streams_config else 1,
        moe_layers=moe_layers(config) if n_experts else (),
        sites=frozenset(arch.sites) | MODEL_LEVEL,
        refused=tuple(sorted(arch.refused.items())),
        layer_kinds=tuple(getattr(config, arch.layer_kinds)) if arch.layer_kinds else (),
        d_head_qk=next((getattr(config, n) for n in arch.d_head_qk_from if getattr(config, n, None)), 0),
        attention_layers=attention_layers(config, arch),
    )


def attention_layers(config, arch: Arch) -> tuple[int, ...]:
    """The layers whose kind is one of ``arch.attention_kinds`` (empty where every layer attends)."""
    if not arch.attention_kinds:
        return ()
    return tuple(i for i, kind in enumerate(getattr(config, arch.layer_kinds)) if kind in arch.attention_kinds)
