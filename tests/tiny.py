"""Tiny random models for the tests: built from configs with a fixed seed, saved as ordinary
Hugging Face folders (weights + a byte-level tokenizer) that both backends load. Nothing is
downloaded.

Sizes respect vLLM-CPU's limits (head_dim 64, MoE hidden sizes multiples of 32).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320  # 256 bytes + specials, rounded up
BOS, EOS = 256, 257

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def configs() -> dict:
    """family name -> transformers config (fp32, 3 layers)."""
    import transformers as t

    return {
        "llama": t.LlamaConfig(**COMMON),
        # every family feature moves the outputs well past the tolerances (tests/eager/test_must_change.py):
        # a window shorter than the test prompts, a scalar other than head_dim, caps the scores reach
        "mistral": t.MistralConfig(**COMMON, sliding_window=8),
        "qwen2": t.Qwen2Config(**COMMON),
        "qwen3": t.Qwen3Config(**COMMON),
        # Phi-3 derives head_dim from hidden_size / heads: 256 / 4 = 64, vLLM-CPU's smallest
        "phi3": t.Phi3Config(**{**COMMON, "hidden_size": 256}),
        "gemma2": t.Gemma2Config(
            **{**COMMON, "tie_word_embeddings": True},
            query_pre_attn_scalar=16,
            sliding_window=8,
            final_logit_softcapping=2.0,
            attn_logit_softcapping=0.5,
        ),
    }


DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")


def byte_tokenizer():
    """A byte-level tokenizer: one token per UTF-8 byte, a BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for ch, b in _bytes_to_unicode().items()}
    vocab["<s>"], vocab["</s>"] = BOS, EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def build_one_kv_head(root: Path) -> Path:
    """The tiny Llama with a single KV head: under tensor parallelism every rank holds a copy."""
    config = configs()["llama"]
    config.num_key_value_heads = 1
    return build("llama", root, config=config)


def build(family: str, root: Path, seed: int = 0, config=None) -> Path:
    """Save a tiny random ``family`` model under ``root/family`` and return the folder."""
    from transformers import AutoModelForCausalLM

    path = Path(root) / family
    if (path / "config.json").exists():
        return path
    config = config or configs()[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the tests see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
