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

The latent itself is not an address. **On vLLM** the attention kernel takes the latent and the
rotary key, not per-head keys and values (in decode it absorbs ``kv_b_proj`` into the query and the
output), so no module boundary carries ``q`` / ``k`` / ``v``: they are refused there, with that
reason; ``z`` (the input of ``o_proj``) is formed and served.
"""

from __future__ import annotations

from . import vllm_reads
from .base import Arch, Hook
from .dense import LLAMA_SITES
from .moe import ROUTER_SITES

_LATENT = ("vLLM runs multi-head latent attention on the compressed latent (kv_lora_rank) and the shared "
           "rotary key, and in decode absorbs kv_b_proj into the query and the output, so the per-head "
           "queries, keys and values are never passed between modules there; capture them with backend='eager'")

VLLM_SITES = {name: read for name, read in vllm_reads.moe("mlp").items() if name not in ("q", "k", "v")}

ARCHS = (
    Arch("deepseek_v3", ("deepseek_v3",), {**LLAMA_SITES, **ROUTER_SITES}, d_head_from=("v_head_dim",),
         n_kv_heads_from=("num_attention_heads",), d_head_qk_from=("qk_head_dim",), vllm=VLLM_SITES,
         vllm_refused={name: _LATENT for name in ("q", "k", "v")}, vllm_attention=""),
)
