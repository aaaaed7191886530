"""OLMo 2 and OLMo 3 on the eager backend: no pre-norms, each block's output normed before the
residual add, q / k norms over all heads, and (OLMo 3) sliding-window layers; checked against HF's
hidden states, attentions and logits and each layer written out from its weights
(tests/archs/family_oracle.py)."""

import pytest
import torch

from interp_engine import run_with_cache

from . import family_oracle as oracle
from ..oracles import REL_SAME, assert_near

PROMPT = "The quick brown fox jumps over"
LAYOUT = oracle.Layout(pre_attn=None, post_attn="post_attention_layernorm", pre_mlp=None,
                       post_mlp="post_feedforward_layernorm", qk_norm="all")


@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family, eager_models):
    return eager_models(family)


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(PROMPT)


@pytest.fixture(scope="module")
def cache(model, tokens):
    return run_with_cache(model, tokens, [*oracle.DENSE, "pattern", "mlp_post", "logits"])


def test_family_record(model, family):
    assert model.info.family == family
    assert model.info.d_head == 64 and model.info.n_kv_heads == 2 and model.info.d_mlp == 256


def test_residuals_and_logits_equal_hf(model, tokens):
    oracle.check_residuals_against_hf(model, tokens)


def test_identities(model, cache):
    oracle.check_identities(model, cache)


def test_blocks_read_the_residual_itself(model, cache):
    """With no pre-norms, attention reads ``resid_pre`` and the MLP reads ``resid_mid`` unnormed:
    the MLP's own input is ``resid_mid``."""
    for layer in range(model.info.n_layers):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            raw = block.mlp(cache.get("resid_mid", layer))
        assert_near(raw, cache.get("mlp_out", layer), f"mlp_out.{layer}", REL_SAME)
        assert_near(block.post_feedforward_layernorm(raw), cache.get("mlp_out_post", layer), f"mlp_out_post.{layer}",
                    REL_SAME)


def test_attention_by_hand(model, cache):
    oracle.check_attention_by_hand(model, cache, LAYOUT)


def test_pattern_equals_hf_attentions(model, family, tiny_path, tokens):
    oracle.check_pattern_against_hf(model, tiny_path(family), tokens)


def test_sliding_layers_see_only_their_window(model, family, cache):
    """OLMo 3's sliding layers (window 4) give no weight to keys 4 or more back; OLMo 2 has none."""
    kinds = getattr(model.hf.config, "layer_types", None) if family == "olmo3" else None
    for layer in range(model.info.n_layers):
        far = cache.get("pattern", layer)[0].tril(-4)
        if kinds and kinds[layer] == "sliding_attention":
            assert torch.equal(far, torch.zeros_like(far)), layer
        else:
            assert far.abs().max() > 0, layer


def test_mlp_by_hand(model, cache):
    oracle.check_mlp_by_hand(model, cache, LAYOUT)


def test_edits_by_hand(model, tokens):
    oracle.check_edits_by_hand(model, tokens, "post_attention_layernorm")


def test_positions(model, tokens):
    oracle.check_positions(model, tokens, ["resid_mid.1", "z.2", "pattern.0", "mlp_post.1", "logits"])
