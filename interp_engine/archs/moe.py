"""Site tables of the mixture-of-experts families.

An MoE layer's feed-forward block is a router (``mlp.gate``) and a bank of experts. In
transformers 5.19 every router listed here returns ``(router_logits, weights, indices)`` over
the flattened tokens, and the block hands exactly that ``weights`` / ``indices`` pair to its
experts. So the three MoE sites read the router's output: ``router_logits`` is the gate output,
and ``expert_weights`` / ``expert_indices`` are the selection the experts actually consumed —
after the family's own rule (softmax then top-k, renormalised when ``norm_topk_prob``; or
DeepSeek's scored, bias-corrected, hash-routed and scaled selection). Nothing is re-derived.

Which layers are MoE layers is read from the config (:func:`moe_layers`); the other layers
keep a dense MLP, where ``mlp_post`` is served and the MoE sites are not.
"""

from __future__ import annotations

from . import vllm_reads
from .base import Arch, Hook
from .dense import GATED_MLP, LLAMA_SITES, QK_NORMS

#: the three outputs of a router, over the flattened ``[batch * pos]`` tokens
ROUTER_SITES = {
    "router_logits": Hook("mlp.gate", "out", index=0, layout="(b p) ..."),
    "expert_weights": Hook("mlp.gate", "out", index=1, layout="(b p) ..."),
    "expert_indices": Hook("mlp.gate", "out", index=2, layout="(b p) ..."),
}

#: values of a config's ``mlp_layer_types`` that mean "this layer routes to experts"
MOE_LAYER_TYPES = ("moe", "hash_moe", "sparse")

ARCHS = (
    # Qwen3-MoE, OLMoE and Mixtral keep Llama's layer layout, with ``mlp`` a sparse MoE block.
    Arch("qwen3_moe", ("qwen3_moe",), {**LLAMA_SITES, **GATED_MLP, **QK_NORMS, **ROUTER_SITES},
         vllm=vllm_reads.moe("mlp")),
    Arch("olmoe", ("olmoe",), {**LLAMA_SITES, **QK_NORMS, **ROUTER_SITES}, vllm=vllm_reads.moe("mlp")),
    Arch("mixtral", ("mixtral",), {**LLAMA_SITES, **ROUTER_SITES}, vllm=vllm_reads.moe("block_sparse_moe")),
)


def moe_layers(config) -> tuple[int, ...]:
    """The layers whose feed-forward block is an MoE block, read from the config.

    ``mlp_layer_types`` (DeepSeek-V4, HY-v4, GLM5-next) names each layer's block; otherwise
    DeepSeek-V3's ``first_k_dense_replace`` (its first k layers are dense) and Qwen-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step`` apply; otherwise every layer.
    """
    n = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None)
    if types:
        return tuple(i for i, kind in enumerate(types) if kind in MOE_LAYER_TYPES)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    dense |= set(range(getattr(config, "first_k_dense_replace", 0) or 0))
    step = getattr(config, "decoder_sparse_step", None) or 1
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
