"""Site table of DeepSeek-V3: multi-head latent attention (MLA) and an MoE block with a shared
expert (the first ``first_k_dense_replace`` layers keep a dense MLP).

**What the per-head sites mean under MLA.** Each token's keys and values are compressed into one
latent (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm``, width ``kv_lora_rank``) plus one rotary key
shared by every head; ``kv_b_proj`` decompresses the latent into each head's no-position key part
and its value. The queries come through a low-rank pair (``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj``) and are split the same way. The attention scores are formed exactly as in ordinary
multi-head attention on the decompressed tensors, and those are what the sites hold:

- ``q.L`` ``[b, p, n_heads, qk_nope_head_dim + qk_rope_head_dim]``: the no-position part, then the
  rotary part after rotary, as the scores use them;
- ``k.L`` ``[b, p, n_heads, qk_nope_head_dim + qk_rope_head_dim]``: each head's decompressed key,
  its rotary part (after rotary) the same in every head; there are as many key heads as query
  heads (``n_kv_heads = n_heads``: no grouping once decompressed);
- ``v.L`` ``[b, p, n_heads, v_head_dim]`` and ``z.L`` ``[b, p, n_heads, v_head_dim]`` (the input of
  ``o_proj``), so ``d_head = v_head_dim`` and ``head_contributions`` work as everywhere;
  ``ModelInfo.d_head_qk`` is the query / key width;
- ``pattern.L``: the softmax of those scores (eager).

The latent itself is not an address.

**Not on vLLM.** vLLM 0.32's CPU build starts a DeepSeek-V3 model (its MLA kernel needs
``kv_lora_rank + qk_rope_head_dim = 576``, and the routers' correction bias needs
``topk_method="noaux_tc"`` in the config), but its CPU rotary kernel (``RotaryEmbedding.forward_cpu``)
rotates the strided rope slice of MLA's queries wrongly: every head but the first gets other
values (seen even at position 0, where rotary is the identity; ``forward_native`` is exact), so
its attention is not the model's (``z`` 2% away from the eager backend on a tiny model). The vLLM
backend refuses the family with that reason before an engine starts. Were it fixed, the per-head
``q`` / ``k`` / ``v`` would still have no module boundary there (the kernel takes the latent and
the rotary key, and decode absorbs ``kv_b_proj`` into the query and the output); ``z``, the input
of ``o_proj``, would.
"""

from __future__ import annotations

from .base import Arch, Hook
from .dense import GATED_MLP, LLAMA_SITES
from .moe import ROUTER_SITES

_VLLM_CPU_ROPE = ("vLLM 0.32's CPU rotary kernel (RotaryEmbedding.forward_cpu) rotates the strided rope slice of "
                  "multi-head latent attention's queries wrongly for every head but the first, so the engine's "
                  "attention is not the model's (z 2% away from eager on a tiny DeepSeek-V3; docs/MOE.md)")

ARCHS = (
    Arch("deepseek_v3", ("deepseek_v3",), {**LLAMA_SITES, **GATED_MLP, **ROUTER_SITES}, d_head_from=("v_head_dim",),
         n_kv_heads_from=("num_attention_heads",), d_head_qk_from=("qk_head_dim",),
         vllm_unsupported=_VLLM_CPU_ROPE),
)
