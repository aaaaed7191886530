"""Per-architecture knowledge, held as data.

Each model family is one :class:`Arch`: where its decoder layers live, and for every site of
the address space which module of a layer to hook and whether to read that module's input or
its output. The capture code of every backend reads these tables; it holds no branches on the
family. A family that is not listed raises an error naming the ones that are.
"""

from __future__ import annotations

import dataclasses

from ..address import ModelInfo


@dataclasses.dataclass(frozen=True)
class Hook:
    """Read the input (``"in"``) or the output (``"out"``) of ``module`` inside a decoder layer.

    ``module`` is a dotted path relative to the layer; ``""`` is the layer itself.
    ``"attention"`` reads the attention function's arguments/results (q, k, v, pattern).
    ``index`` picks the element of a tuple output (a router returns logits, weights, indices).
    ``layout`` says how the tensor is laid out when it is not ``[batch, pos, ...]``: one of
    ``LAYOUTS`` (the recorder turns each into ``[batch, pos, ...]``, picking the stream).
    """

    module: str
    kind: str  # "in" | "out" | "attention"
    index: int = 0
    layout: str = ""


#: tensor layouts a hook may read; b batch, p position, s stream, d features
LAYOUTS = ("", "(b p) ...", "b p s d", "s b p d", "b p (s d)")


@dataclasses.dataclass(frozen=True)
class Arch:
    family: str
    model_types: tuple[str, ...]
    sites: dict[str, Hook]
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    unembed: str = "lm_head"
    attention: str = "self_attn"
    o_proj: str = "self_attn.o_proj"
    #: config attribute holding the number of residual streams ("" for a single stream)
    streams_config: str = ""


_ATTENTION = {name: Hook("self_attn", "attention") for name in ("q", "k", "v", "pattern")}

#: Llama and everything that shares its layer layout (Mistral, Qwen2, Qwen3).
_LLAMA_SITES = {
    "resid_pre": Hook("", "in"),
    "attn_out": Hook("self_attn", "out"),
    "resid_mid": Hook("post_attention_layernorm", "in"),
    "mlp_out": Hook("mlp", "out"),
    "resid_post": Hook("", "out"),
    "z": Hook("self_attn.o_proj", "in"),
    "mlp_post": Hook("mlp.down_proj", "in"),
    "resid_streams": Hook("", "out"),
    **_ATTENTION,
}

#: Gemma 2 normalises each block's output before adding it to the residual.
_GEMMA2_SITES = {
    **_LLAMA_SITES,
    "attn_out": Hook("post_attention_layernorm", "out"),
    "resid_mid": Hook("pre_feedforward_layernorm", "in"),
    "mlp_out": Hook("post_feedforward_layernorm", "out"),
}

ARCHS: list[Arch] = [
    Arch("llama", ("llama", "mistral", "qwen2", "qwen3"), _LLAMA_SITES),
    Arch("gemma2", ("gemma2",), _GEMMA2_SITES),
]


def _extend() -> None:
    """Join the families kept in their own modules (they build on the tables above)."""
    from .moe import ARCHS as moe_archs
    from .streams import ARCHS as stream_archs

    ARCHS.extend(moe_archs + stream_archs)


_extend()


def register(arch: Arch) -> None:
    """Add a family at run time (the built-in ones are listed above or joined by ``_extend``)."""
    ARCHS.append(arch)


def arch_for(config) -> Arch:
    model_type = getattr(config, "model_type", None)
    for arch in ARCHS:
        if model_type in arch.model_types:
            return arch
    known = sorted(t for a in ARCHS for t in a.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported yet; supported: {', '.join(known)}")


def model_info(config, name: str) -> ModelInfo:
    """The address-relevant facts of a transformers config."""
    from .moe import moe_layers

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
