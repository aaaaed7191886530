"""Site tables of the dense single-stream families: Llama and the families that share its decoder
layer (Mistral, Qwen2, Qwen3, Phi-3: fused qkv and gate-up projections, but the same modules
around them), and Gemma 2 (post-block norms). A family whose layers have Llama's module names is
supported on both backends by adding its ``model_type`` to the Llama row."""

from __future__ import annotations

import dataclasses

from . import vllm_reads
from .base import Arch, Hook

ATTENTION = {name: Hook("self_attn", "attention") for name in ("q", "k", "v", "pattern", "attn_scores")}

#: what each block is handed and the pre-norms' outputs before their gain, in a layer with Llama's
#: module names (``mlp_in`` is the MoE block's input on an MoE layer)
BLOCK_INPUTS = {
    "attn_in": Hook("self_attn", "in"),
    "mlp_in": Hook("mlp", "in"),
    "ln1_normalized": Hook("input_layernorm", "normalized"),
    "ln2_normalized": Hook("post_attention_layernorm", "normalized"),
}

#: the q / k norms inside attention (Qwen3, Gemma 3, OLMo 2 / 3, the hybrids' attention layers)
QK_NORMS = {f"{x}_norm_{io}": Hook(f"self_attn.{x}_norm", io) for x in ("q", "k") for io in ("in", "out")}

#: Gemma 3 applies them per head after moving the heads before the positions (``[b, heads, p, d_head]``)
QK_NORMS_HEADS_FIRST = {name: dataclasses.replace(hook, layout="b h p d") for name, hook in QK_NORMS.items()}

#: a gated MLP with separate gate and up projections: ``act(gate(x)) * up(x)``
GATED_MLP = {"mlp_pre": Hook("mlp.gate_proj", "out"), "mlp_pre_linear": Hook("mlp.up_proj", "out")}

#: Phi-3 fuses the gate and up projections into one ``gate_up_proj``: neither half is a module output
FUSED_GATE_UP = {name: "Phi-3 fuses the gate and up projections into one gate_up_proj, so neither half is a module "
                       "output here; mlp_post (act(gate) * up, the down projection's input) is served"
                 for name in ("mlp_pre", "mlp_pre_linear")}

#: Llama and everything that shares its layer layout (Mistral, Qwen2, Qwen3).
LLAMA_SITES = {
    **BLOCK_INPUTS,
    "resid_pre": Hook("", "in"),
    "attn_out": Hook("self_attn", "out"),
    "resid_mid": Hook("post_attention_layernorm", "in"),
    "mlp_out": Hook("mlp", "out"),
    "resid_post": Hook("", "out"),
    "z": Hook("self_attn.o_proj", "in"),
    "mlp_post": Hook("mlp.down_proj", "in"),
    "resid_streams": Hook("", "out"),
    **ATTENTION,
}

#: Gemma 2 normalises each block's output before adding it to the residual: ``attn_out`` / ``mlp_out``
#: are the blocks' raw outputs, ``attn_out_post`` / ``mlp_out_post`` the normed ones the residual adds.
GEMMA2_SITES = {
    **LLAMA_SITES,
    "attn_out_post": Hook("post_attention_layernorm", "out"),
    "resid_mid": Hook("pre_feedforward_layernorm", "in"),
    "ln2_normalized": Hook("pre_feedforward_layernorm", "normalized"),
    "mlp_out_post": Hook("post_feedforward_layernorm", "out"),
    **GATED_MLP,
}

#: Qwen3 normalises each head's query and key before rotary
QWEN3_SITES = {**LLAMA_SITES, **GATED_MLP, **QK_NORMS}

ARCHS = (
    Arch("llama", ("llama", "mistral", "qwen2"), {**LLAMA_SITES, **GATED_MLP}, vllm=vllm_reads.LLAMA),
    # Qwen3 is Llama's record plus its q / k norms
    Arch("llama", ("qwen3",), QWEN3_SITES, vllm=vllm_reads.LLAMA),
    # Phi-3 is Llama's record but for its fused gate / up projection
    Arch("llama", ("phi3",), LLAMA_SITES, vllm=vllm_reads.LLAMA, refused=FUSED_GATE_UP),
    Arch("gemma2", ("gemma2",), GEMMA2_SITES, logit_softcap="final_logit_softcapping", vllm=vllm_reads.GEMMA2),
)
