"""The Cache analysis helpers, each against the identity it must satisfy, on every dense family
(eager): stack is the layers side by side, the accumulated residual at L is resid_pre.L, the
decomposition sums to the last resid_post, the frozen final norm reproduces final_norm, and the
logit attributions sum to the logits. Also whole-site points, filters, model.points() and the
token helpers."""

from __future__ import annotations

import pytest
import torch

from interp_engine import (Address, AddressError, accumulated_resid, decompose_resid, final_scale, head_contributions,
                           logit_attribution, run_with_cache, stack)

from ..oracles import assert_near
from ..tiny import DENSE_FAMILIES
from ..devices import on

PROMPTS = ["The quick brown fox", "jumps over"]


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def model(request, eager_models):
    return eager_models(request.param)


@pytest.fixture(scope="module")
def cache(model):
    tokens = model.tok.to_tokens(PROMPTS)
    return run_with_cache(model, tokens, ["resid_pre", "resid_post", "attn_out", "attn_out_post", "mlp_out_post", "z",
                                          "logits"])


def test_stack_is_the_layers_side_by_side(model, cache):
    stacked = stack(cache, "resid_post")
    assert stacked.shape == (model.n_layers, *cache["resid_post.0"].shape)
    for L in range(model.n_layers):
        assert torch.equal(stacked[L], cache.get("resid_post", L))
    assert torch.equal(stack(cache, "z", [2, 0])[0], cache.get("z", 2))
    with pytest.raises(KeyError, match=r"needs mlp_post at layers any.*holds mlp_post at no layer"):
        stack(cache, "mlp_post")


def test_accumulated_resid_at_L_is_resid_pre_L(model, cache):
    acc, labels = accumulated_resid(cache, return_labels=True)
    assert acc.shape[0] == model.n_layers + 1 and labels[-1] == f"resid_post.{model.n_layers - 1}"
    for L in range(model.n_layers):
        assert torch.equal(acc[L], cache.get("resid_pre", L))
    assert torch.equal(acc[-1], cache.get("resid_post", model.n_layers - 1))
    # from a cache that holds resid_post only (and the embedding): the same tensors
    posts = run_with_cache(model, cache.tokens, ["resid_pre.0", "resid_post"])
    assert torch.equal(accumulated_resid(posts, 2)[2], cache.get("resid_pre", 2))
    assert accumulated_resid(posts, 1).shape[0] == 2
    normed = accumulated_resid(cache, apply_ln=True, model=model)
    assert torch.equal(normed[1], model.final_norm(cache.get("resid_pre", 1)))
    with pytest.raises(KeyError, match="capture 'resid_pre.0'"):
        accumulated_resid(run_with_cache(model, cache.tokens, ["resid_post"]), 1)
    with pytest.raises(ValueError, match="needs the model's final norm"):
        accumulated_resid(cache, apply_ln=True)


def test_decomposition_sums_to_the_last_resid_post(model, cache):
    parts, labels = decompose_resid(cache, return_labels=True)
    assert labels[:3] == ["embed", "attn_out_post.0", "mlp_out_post.0"] and len(labels) == 1 + 2 * model.n_layers
    assert_near(parts.sum(0), cache.get("resid_post", model.n_layers - 1), "sum of components", rel=1e-6)
    assert_near(decompose_resid(cache, 1).sum(0), cache.get("resid_pre", 1), "up to layer 1", rel=1e-6)


def test_final_scale_is_the_final_norm_frozen_at_the_residual(model, cache):
    resid = cache.get("resid_post", model.n_layers - 1)
    assert_near(resid * final_scale(model, resid), model.final_norm(resid), "final_scale", rel=1e-6)


def test_logit_attributions_sum_to_the_logits(model, cache):
    cap = getattr(model.hf.config, "final_logit_softcapping", None)
    targets = cache.tokens.clamp(min=0)  # an id per position
    attr = logit_attribution(model, cache, targets)
    assert attr.shape == (1 + 2 * model.n_layers, *targets.shape)
    logits = model.hf.lm_head(model.final_norm(cache.get("resid_post", model.n_layers - 1)))  # before softcap
    want = logits.gather(-1, on(model, targets)[..., None])[..., 0]
    real = cache.mask
    assert_near(attr.sum(0)[real], want[real], "sum of attributions", rel=1e-5)
    if not cap:
        assert_near(attr.sum(0)[real], cache["logits"].gather(-1, on(model, targets)[..., None])[..., 0][real], "logits",
                    rel=1e-5)
    one = logit_attribution(model, cache, 7)
    assert_near(one.sum(0)[real], logits[..., 7][real], "one token id", rel=1e-5)
    direction = model.unembed_weight()[7].detach()
    assert torch.equal(logit_attribution(model, cache, direction), one)
    # per head: head_contributions through the same frozen norm; the heads sum to attn_out's share
    # (attn_out is the raw output of o_proj, which has no bias in these families; Gemma 2's
    # attn_out_post is that output through its post-attention norm, so not the heads' sum)
    heads = head_contributions(model, cache, 1).permute(2, 0, 1, 3)  # [heads, b, p, d]
    per_head = logit_attribution(model, cache, 7, components=heads)
    attn = logit_attribution(model, cache, 7, components=cache.get("attn_out", 1)[None])[0]
    assert_near(per_head.sum(0)[real], attn[real], "heads sum to attn_out", rel=1e-5)


def test_whole_sites_filters_and_points(model):
    info = model.info
    assert model.points("resid_post") == [Address("resid_post", L) for L in range(info.n_layers)]
    everything = model.points()
    assert everything[0].name == "embeddings"
    assert [a.name for a in everything[-4:]] == ["ln_final_normalized", "final_norm", "lm_head", "logits"]
    assert [a.layer for a in everything[1:-4]] == sorted(a.layer for a in everything[1:-4])
    tokens = model.to_tokens("sites")
    cache = run_with_cache(model, tokens, ["resid_post", "resid_streams.1", lambda a: a.name == "z" and a.layer > 0])
    assert [str(a) for a in cache] == ([f"resid_post.{L}" for L in range(info.n_layers)] + ["resid_streams.1.0"]
                                       + [f"z.{L}" for L in range(1, info.n_layers)])
    with pytest.raises(AddressError, match="matched no address"):
        run_with_cache(model, tokens, [lambda a: a.layer == 99])
    with pytest.raises(AddressError, match="dense model and has no MoE router"):
        run_with_cache(model, tokens, ["router_logits"])
    with pytest.raises(AddressError, match="layer 7 is out of range"):
        run_with_cache(model, tokens, ["resid_streams.7"])
    with pytest.raises(AddressError, match="unknown site 'nonsense'"):
        model.points("nonsense")


def test_token_helpers(model):
    text = "Hi there"
    ids = model.to_tokens(text)
    assert model.to_str_tokens(text) == model.to_str_tokens(ids) == model.to_str_tokens(ids[0])
    assert "".join(model.to_str_tokens(text)) == model.to_string(ids)
    batch = model.tok.to_tokens(["a b", "longer text"])
    assert model.to_str_tokens(batch) == [model.to_str_tokens("a b"), model.to_str_tokens("longer text")]
    assert model.to_string(batch) == [model.to_string(model.to_tokens("a b")), model.to_string(model.to_tokens("longer text"))]
    bos = model.tok.hf.bos_token_id
    assert model.to_tokens(text)[0, 0] == bos  # the tiny tokenizers prepend their BOS by default
    assert model.to_tokens(text, prepend_bos=False)[0, 0] != bos
    assert torch.equal(model.to_tokens(text, prepend_bos=True), ids)
    assert model.to_str_tokens(text, prepend_bos=False) == model.to_str_tokens(text)[1:]
