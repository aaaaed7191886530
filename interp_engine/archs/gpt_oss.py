"""Site table of GPT-OSS: attention with learned sinks and an MoE feed-forward block on every layer.

**Attention sinks.** Each head has a learned logit ``sink`` that joins the softmax as one extra
column: ``softmax([q.k_1 * s, ..., q.k_n * s, sink])``. That column is dropped before the values
are mixed, so the sink absorbs probability mass but contributes no value. ``pattern.L`` is the
probability over the *real* keys only, exactly what multiplies ``v``: its rows sum to
``1 - p(sink)``, not to 1, and ``z = pattern @ v`` holds. The sink's own probability per row is
``1 - pattern.sum(-1)``.

**MoE.** The router (``mlp.router``) is a biased linear map: ``router_logits = x W^T + b``; it
takes the top-k logits and softmaxes over those k only (``expert_weights``, which sum to 1), and
the experts module is handed exactly that ``(indices, weights)`` pair, read here as for the other
MoE families (:mod:`.moe`). Each expert is a clamped SwiGLU whose gate and up projections are
stored interleaved (even / odd columns of ``gate_up_proj``), so there is no one ``mlp_post``:
every layer is an MoE layer and ``mlp_post`` is refused, as on every MoE layer. The block returns
``(output, router_scores)``; ``mlp_out`` is the output.

**On vLLM** (its own ``GptOssForCausalLM``): the attention block is ``attn`` (not ``self_attn``), the
router ``mlp.router`` returns the logits alone, and the experts' runner selects through
``router.select_experts`` as for the other MoE families (:func:`.vllm_reads.moe`). vLLM's attention
kernel takes the sinks itself and never forms the probabilities, so ``pattern`` stays eager-only.
"""

from __future__ import annotations

from . import vllm_reads
from .base import Arch, Hook
from .dense import ATTENTION, BLOCK_INPUTS

GPT_OSS_SITES = {
    **BLOCK_INPUTS,
    "resid_pre": Hook("", "in"),
    "attn_out": Hook("self_attn", "out"),
    "resid_mid": Hook("post_attention_layernorm", "in"),
    "mlp_out": Hook("mlp", "out", index=0),
    "resid_post": Hook("", "out"),
    "z": Hook("self_attn.o_proj", "in"),
    "resid_streams": Hook("", "out"),
    "router_logits": Hook("mlp.router", "out", index=0, layout="(b p) ..."),
    "expert_weights": Hook("mlp.router", "out", index=1, layout="(b p) ..."),
    "expert_indices": Hook("mlp.router", "out", index=2, layout="(b p) ..."),
    **ATTENTION,
}

_MOE_ONLY = ("every GPT-OSS layer is an MoE layer, whose experts each have their own hidden activation (a "
             "clamped SwiGLU over interleaved gate / up columns), so there is no one MLP neuron activation; for "
             "the routing use router_logits / expert_weights / expert_indices")

#: vLLM's reads: Llama's, with the attention block at ``attn`` and the router at ``mlp.router``
VLLM_SITES = {
    **{name: read for name, read in vllm_reads.moe("mlp").items() if name != "mlp_post"},
    "attn_out": Hook("attn", "out", parts=(0,)),
    "z": Hook("attn.o_proj", "in", parts=("input_",), shard="heads"),
    **{name: Hook("attn.attn", "in", parts=(arg,), shard=shard)
       for name, arg, shard in (("q", "query", "heads"), ("k", "key", "kv"), ("v", "value", "kv"))},
    "router_logits": Hook("mlp.router", "out", parts=(0,)),
}

ARCHS = (Arch("gpt_oss", ("gpt_oss",), GPT_OSS_SITES,
              refused={name: _MOE_ONLY for name in ("mlp_post", "mlp_pre", "mlp_pre_linear")}, vllm=VLLM_SITES,
              vllm_attention="attn.attn", vllm_paths={"o_proj": "attn.o_proj"}),)
