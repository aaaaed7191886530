"""GPT-OSS on the eager backend: attention with learned sinks (``pattern`` over the real keys),
sliding-window and global layers, and an MoE block on every layer (biased router, top-k softmax,
experts with interleaved gate / up columns). Checked against HF's hidden states, attentions and
logits, and against each layer's attention, router and experts written out from the weights."""

import pytest
import torch
import torch.nn.functional as F

from interp_engine import AddressError, run_with_cache

from . import family_oracle as oracle
from ..oracles import REL_SAME, assert_near

PROMPT = "The quick brown fox jumps over"
LAYOUT = oracle.Layout(sink=True)
MOE = ["router_logits", "expert_weights", "expert_indices"]


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("gpt_oss")


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(PROMPT)


@pytest.fixture(scope="module")
def cache(model, tokens):
    return run_with_cache(model, tokens, [*oracle.DENSE, "pattern", *MOE, "logits"])


def test_family_record(model):
    info = model.info
    assert (info.family, info.n_experts, info.top_k, info.moe_layers) == ("gpt_oss", 8, 2, (0, 1, 2))


def test_residuals_and_logits_equal_hf(model, tokens):
    oracle.check_residuals_against_hf(model, tokens)


def test_identities(model, cache):
    oracle.check_identities(model, cache)


def test_attention_with_sinks_by_hand(model, cache):
    oracle.check_attention_by_hand(model, cache, LAYOUT)


def test_pattern_is_over_real_keys_and_the_sink_takes_the_rest(model, cache):
    """Each row of ``pattern`` sums to one minus the sink's probability, which is
    ``exp(sink) / (exp(sink) + sum_j exp(score_j))`` for that head and query."""
    for layer in range(model.info.n_layers):
        pattern = cache.get("pattern", layer)
        want = oracle.manual_attention(model.hf, layer, cache.get("resid_pre", layer), LAYOUT)["pattern"]
        sink_mass = 1 - pattern.sum(-1)
        assert sink_mass.min() > 1e-4, "the sinks take some probability on every row"
        assert_near(sink_mass, 1 - want.sum(-1), f"sink mass {layer}", REL_SAME)
        assert_near(torch.einsum("bhqk,bkhd->bqhd", pattern, cache.get("v", layer).repeat_interleave(2, 2)),
                    cache.get("z", layer), f"z = pattern @ v, layer {layer}", REL_SAME)


def test_pattern_equals_hf_attentions(model, tiny_path, tokens):
    oracle.check_pattern_against_hf(model, tiny_path("gpt_oss"), tokens)


def test_router_by_hand(model, cache):
    """``router_logits = x W^T + b`` on the normed ``resid_mid``; the selection is its top-k, and the
    weights a softmax over those k logits only."""
    for layer in range(model.info.n_layers):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            x = block.post_attention_layernorm(cache.get("resid_mid", layer))
            logits = F.linear(x, block.mlp.router.weight, block.mlp.router.bias)
        assert_near(cache.get("router_logits", layer), logits, f"router_logits.{layer}", REL_SAME)
        top, ids = logits.topk(model.info.top_k, dim=-1)
        got_ids, got_w = cache.get("expert_indices", layer), cache.get("expert_weights", layer)
        assert torch.equal(got_ids.sort(-1).values, ids.sort(-1).values)
        assert_near(got_w.gather(-1, got_ids.argsort(-1)), top.softmax(-1).gather(-1, ids.argsort(-1)),
                    f"expert_weights.{layer}", REL_SAME)


def _expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """One GPT-OSS expert: gate and up are the even and odd columns of ``gate_up_proj``, both
    clamped, then ``(up + 1) * gate * sigmoid(alpha * gate)`` through the down projection."""
    gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
    gate, up = gate_up[..., 0::2].clamp(max=experts.limit), gate_up[..., 1::2].clamp(-experts.limit, experts.limit)
    return ((up + 1) * gate * torch.sigmoid(gate * experts.alpha)) @ experts.down_proj[e] + experts.down_proj_bias[e]


def test_mlp_out_is_the_weighted_experts(model, cache):
    for layer in range(model.info.n_layers):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            x = block.post_attention_layernorm(cache.get("resid_mid", layer))[0]
            ids, weights = cache.get("expert_indices", layer)[0], cache.get("expert_weights", layer)[0]
            want = torch.stack([sum(w * _expert(block.mlp.experts, int(e), x[t]) for e, w in zip(ids[t], weights[t]))
                                for t in range(x.shape[0])])
        assert_near(cache.get("mlp_out", layer)[0], want, f"mlp_out.{layer}", REL_SAME)


def test_mlp_post_is_refused_on_moe_layers(model, tokens):
    with pytest.raises(AddressError, match="every GPT-OSS layer is an MoE layer") as err:
        run_with_cache(model, tokens, ["mlp_post.0"])
    assert "use router_logits / expert_weights / expert_indices" in str(err.value)


def test_edits_by_hand(model, tokens):
    oracle.check_edits_by_hand(model, tokens, "self_attn")


def test_positions(model, tokens):
    oracle.check_positions(model, tokens, ["resid_post.1", "z.2", "pattern.0", "expert_indices.1", "logits"])
