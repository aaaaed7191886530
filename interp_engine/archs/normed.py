"""Site tables of the dense families that normalise what a block writes before adding it to the
residual, or scale the embedding: Gemma 1, Gemma 3, OLMo 2 and OLMo 3 (Gemma 2 is in ``dense.py``).

- **Gemma 1** has Llama's layer (pre-norms only, a GeGLU MLP) and multiplies the embedding by
  ``sqrt(d_model)`` before layer 0, so ``resid_pre.0`` (layer 0's input) is the scaled embedding.
- **Gemma 3** has Gemma 2's four norms around the two blocks, plus q / k norms inside attention
  (before rotary, so ``q`` / ``k`` are after both), and interleaves sliding-window and global
  layers; its embedding module scales itself.
- **OLMo 2 / OLMo 3** have no pre-norms: each block reads the residual itself and its output is
  normed (``post_attention_layernorm`` / ``post_feedforward_layernorm``) before the add. The
  q / k norms span all heads, before rotary. OLMo 3 interleaves sliding-window layers.

In each (as in Gemma 2), ``attn_out`` / ``mlp_out`` are the blocks' raw outputs and ``attn_out_post`` /
``mlp_out_post`` the normed outputs, exactly what is added to the residual, so ``resid_mid =
resid_pre + attn_out_post`` and ``resid_post = resid_mid + mlp_out_post``.

On vLLM, Gemma 1 and 3 run in vLLM's own model classes (Llama's and Gemma 2's reads); OLMo 2 and 3
run through vLLM's Transformers backend, which calls the Hugging Face decoder layers on the flat
batch as a batch of one (``layout=ONE``): the reads are the eager ones, and ``q`` / ``k`` / ``v``
are refused there (the backend calls its attention kernel without a module call that carries them).
"""

from __future__ import annotations

from . import vllm_reads
from .base import ONE, Arch, Hook
from .dense import ATTENTION, GATED_MLP, GEMMA2_SITES, LLAMA_SITES, QK_NORMS, QK_NORMS_HEADS_FIRST
from .gpt import NO_QKV_ON_TRANSFORMERS_BACKEND

#: OLMo 2 / 3: no pre-norms, so the MLP's input is ``resid_mid`` itself.
OLMO2_SITES = {
    "resid_pre": Hook("", "in"),
    "attn_in": Hook("self_attn", "in"),
    "mlp_in": Hook("mlp", "in"),
    **GATED_MLP,
    **QK_NORMS,
    "attn_out": Hook("self_attn", "out"),
    "attn_out_post": Hook("post_attention_layernorm", "out"),
    "resid_mid": Hook("mlp", "in"),
    "mlp_out": Hook("mlp", "out"),
    "mlp_out_post": Hook("post_feedforward_layernorm", "out"),
    "resid_post": Hook("", "out"),
    "z": Hook("self_attn.o_proj", "in"),
    "mlp_post": Hook("mlp.down_proj", "in"),
    "resid_streams": Hook("", "out"),
    **ATTENTION,
}

#: OLMo 2 / 3 on vLLM's Transformers backend: the Hugging Face layer, ``[1, tokens, ...]``
OLMO2_VLLM = {
    "resid_pre": Hook("", "in", parts=("hidden_states",), layout=ONE),
    "attn_out": Hook("self_attn", "out", parts=(0,), layout=ONE),
    "attn_out_post": Hook("post_attention_layernorm", "out", parts=(0,), layout=ONE),
    "resid_mid": Hook("mlp", "in", parts=("x",), layout=ONE),
    "mlp_out": Hook("mlp", "out", parts=(0,), layout=ONE),
    "mlp_out_post": Hook("post_feedforward_layernorm", "out", parts=(0,), layout=ONE),
    "resid_post": Hook("", "out", parts=(0,), layout=ONE),
    "z": Hook("self_attn.o_proj", "in", parts=("input_",), shard="heads", layout=ONE),
    "mlp_post": Hook("mlp.down_proj", "in", parts=("input_",), shard="cols", layout=ONE),
}

_NO_PRE_NORM = {
    "ln1_normalized": "OLMo 2 / 3 have no pre-attention norm: attention reads the residual itself (attn_in = resid_pre)",
    "ln2_normalized": "OLMo 2 / 3 have no pre-MLP norm: the MLP reads the residual itself (mlp_in = resid_mid)",
}

_OLMO_ON_VLLM = dict(vllm=OLMO2_VLLM, vllm_transformers_backend=True,
                     vllm_refused={name: NO_QKV_ON_TRANSFORMERS_BACKEND for name in ("q", "k", "v")})

ARCHS = (
    Arch("gemma", ("gemma",), {**LLAMA_SITES, **GATED_MLP}, vllm=vllm_reads.LLAMA),
    Arch("gemma3", ("gemma3_text",), {**GEMMA2_SITES, **QK_NORMS_HEADS_FIRST}, logit_softcap="final_logit_softcapping",
         vllm=vllm_reads.GEMMA2),
    Arch("olmo2", ("olmo2",), OLMO2_SITES, refused=_NO_PRE_NORM, **_OLMO_ON_VLLM),
    Arch("olmo3", ("olmo3",), OLMO2_SITES, refused=_NO_PRE_NORM, **_OLMO_ON_VLLM),
)
