"""Gemma 1 (embedding scaled by sqrt(d_model), GeGLU) and Gemma 3 (norms before and after both
blocks, q / k norms, sliding-window and global layers) on the eager backend, against independent
oracles: HF's hidden states, attentions and logits, and each layer written out from its weights
(tests/archs/family_oracle.py)."""

import pytest
import torch

from interp_engine import run_with_cache
from interp_engine.compare import relative_error

from . import family_oracle as oracle
from ..oracles import REL_SAME, assert_near

PROMPT = "The quick brown fox jumps over"

LAYOUTS = {
    "gemma": oracle.Layout(),
    "gemma3": oracle.Layout(post_attn="post_attention_layernorm", pre_mlp="pre_feedforward_layernorm",
                            post_mlp="post_feedforward_layernorm", qk_norm="head"),
}
#: the module whose output is attn_out_post (what attention adds to the residual)
ATTN_OUT = {"gemma": "self_attn", "gemma3": "post_attention_layernorm"}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
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


def test_resid_pre_0_is_the_scaled_embedding(model, tokens, cache):
    embedding = model.hf.model.embed_tokens.weight[tokens]
    scaled = embedding * torch.tensor(model.d_model**0.5, dtype=embedding.dtype)
    assert_near(cache.get("resid_pre", 0), scaled, "resid_pre.0", REL_SAME)
    assert relative_error(cache.get("resid_pre", 0), embedding) > 0.5  # the scale is not 1


def test_residuals_and_logits_equal_hf(model, tokens):
    oracle.check_residuals_against_hf(model, tokens)


def test_identities(model, cache):
    oracle.check_identities(model, cache)


def test_attention_by_hand(model, family, cache):
    oracle.check_attention_by_hand(model, cache, LAYOUTS[family])


def test_pattern_equals_hf_attentions(model, family, tiny_path, tokens):
    oracle.check_pattern_against_hf(model, tiny_path(family), tokens)


def test_sliding_layers_see_only_their_window(model, family, cache):
    """Gemma 3's sliding layers (window 4) give no weight to keys 4 or more positions back; its
    global layer does."""
    if family != "gemma3":
        pytest.skip("Gemma 1 has no sliding layers")
    kinds = model.hf.config.layer_types
    for layer, kind in enumerate(kinds):
        pattern = cache.get("pattern", layer)[0]
        far = pattern.tril(-4)
        if kind == "sliding_attention":
            assert torch.equal(far, torch.zeros_like(far)), layer
        else:
            assert far.abs().max() > 0, layer


def test_mlp_by_hand(model, family, cache):
    oracle.check_mlp_by_hand(model, cache, LAYOUTS[family])


def test_edits_by_hand(model, family, tokens):
    oracle.check_edits_by_hand(model, tokens, ATTN_OUT[family])


def test_positions(model, tokens):
    oracle.check_positions(model, tokens, ["resid_post.1", "z.2", "pattern.0", "mlp_post.1", "logits"])
