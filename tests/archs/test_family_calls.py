"""The everyday calls on every family issue 21 adds, on the eager backend, against Hugging Face
itself: greedy ``capture_generation`` picks the tokens HF's own ``generate`` picks, its captured
``logits`` are HF's scores for each step, and the logit lens of the last layer is the model's
logits (final norm, softcapping and unembedding as the family applies them). Sizes come from each
family's config names.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from interp_engine import capture_generation, logit_lens, run_with_cache

from .. import tiny_gpt, tiny_recent
from ..oracles import REL_SAME, assert_near

FAMILIES = ("gpt2", "gpt_neox", *tiny_recent.FAMILIES)
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def models(tiny_root):
    from interp_engine import load_model

    loaded = {}

    def get(family):
        if family not in loaded:
            build = tiny_gpt.build if family in ("gpt2", "gpt_neox") else tiny_recent.build
            path = build(family, tiny_root)
            loaded[family] = (load_model(str(path), backend="eager"),
                              AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval())
        return loaded[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_hf_generate(family, models):
    model, hf = models(family)
    tokens = model.to_tokens("The quick brown fox")
    completion, cache = capture_generation(model, tokens, ["logits"], max_tokens=NEW_TOKENS)
    with torch.inference_mode():
        out = hf.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    assert completion.token_ids == out.sequences[0, tokens.shape[1]:].tolist()
    # the logits at the prompt's last position and at each fed-back token are HF's, step by step
    steps = cache["logits"][0, tokens.shape[1] - 1:]
    assert steps.shape[0] == len(completion.token_ids)
    assert_near(steps, torch.stack(out.logits, dim=1)[0], f"{family} logits per step", REL_SAME)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_last_layers_lens_is_the_logits(family, models):
    model, _ = models(family)
    tokens = model.to_tokens("over the lazy dog")
    cache = run_with_cache(model, tokens, [f"resid_post.{model.n_layers - 1}", "resid_post.0", "logits"])
    lens = logit_lens(model, cache, [0, -1])
    assert lens.shape == (2, *cache["logits"].shape)
    assert_near(lens[1], cache["logits"], f"{family} lens of the last layer", REL_SAME)
    assert not torch.allclose(lens[0], lens[1])  # layer 0 reads something else


#: family -> (d_mlp, d_head, n_kv_heads) and the config names they come from
SIZES = {"gpt_oss": ("intermediate_size", "head_dim", "num_key_value_heads"),
         "qwen3_5": ("intermediate_size", "head_dim", "num_key_value_heads"),
         "qwen3_next": ("intermediate_size", "head_dim", "num_key_value_heads"),
         # MLA decompresses a key and a value per query head: no grouping (interp_engine/archs/mla.py)
         "deepseek_v3": ("intermediate_size", "v_head_dim", "num_attention_heads")}


@pytest.mark.parametrize("family", sorted(SIZES))
def test_sizes_come_from_the_config_names(family):
    """The MoE and hybrid families' widths, read under their own config names (d_mlp: the dense
    MLP's width; the experts' width is the MoE sites' business)."""
    from interp_engine.archs import model_info

    config = tiny_recent.config(family)
    info = model_info(config, family)
    assert (info.d_mlp, info.d_head, info.n_kv_heads) == tuple(getattr(config, name) for name in SIZES[family])
    for name, bumped in zip(SIZES[family], ("d_mlp", "d_head", "n_kv_heads")):  # each follows its own name
        changed = tiny_recent.config(family)
        setattr(changed, name, getattr(changed, name) * 2)
        assert getattr(model_info(changed, family), bumped) == getattr(config, name) * 2, (family, name)
