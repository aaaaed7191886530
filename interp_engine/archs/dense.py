"""Site tables of the dense single-stream families: Llama and the families that share its decoder
layer (Mistral, Qwen2, Qwen3, Phi-3: fused qkv and gate-up projections, but the same modules
around them), and Gemma 2 (post-block norms). A family whose layers have Llama's module names is
supported on both backends by adding its ``model_type`` to the Llama row."""

from __future__ import annotations

from . import vllm_reads
from .base import Arch, Hook

ATTENTION = {name: Hook("self_attn", "attention") for name in ("q", "k", "v", "pattern")}

#: Llama and everything that shares its layer layout (Mistral, Qwen2, Qwen3).
LLAMA_SITES = {
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
    "mlp_out_post": Hook("post_feedforward_layernorm", "out"),
}

ARCHS = (
    Arch("llama", ("llama", "mistral", "qwen2", "qwen3", "phi3"), LLAMA_SITES, vllm=vllm_reads.LLAMA),
    Arch("gemma2", ("gemma2",), GEMMA2_SITES, logit_softcap="final_logit_softcapping", vllm=vllm_reads.GEMMA2),
)
