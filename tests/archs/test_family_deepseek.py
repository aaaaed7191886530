"""DeepSeek-V3 on the eager backend: multi-head latent attention (what q / k / v / z mean once the
latent is decompressed, interpreted in interp_engine/archs/mla.py) and an MoE block with a shared
expert behind dense first layers. Checked against HF's hidden states, attentions and logits, the
attention written out from the latent projections' weights, and the router (sigmoid scores,
correction bias, group-limited top-k, scaling) and experts by hand."""

import sys

import pytest
import torch
import torch.nn.functional as F

from interp_engine import Add, AddressError, InputError, Zero, head_contributions, run_with_cache

from . import family_oracle as oracle
from ..oracles import REL_SAME, assert_near

PROMPT = "The quick brown fox jumps over"
MOE = ["router_logits", "expert_weights", "expert_indices"]


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("deepseek_v3")


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(PROMPT)


@pytest.fixture(scope="module")
def cache(model, tokens):
    points = [*oracle.DENSE, "pattern", "mlp_post.0", *(f"{s}.{layer}" for s in MOE for layer in (1, 2)), "logits"]
    return run_with_cache(model, tokens, points)


def test_head_widths_follow_mla(model):
    """``d_head`` is the value width (``z``'s), ``d_head_qk`` the query / key width; one key head
    per query head once the latent is decompressed."""
    config, info = model.hf.config, model.info
    assert (info.d_head, info.d_head_qk) == (config.v_head_dim, config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert info.n_kv_heads == info.n_heads and info.moe_layers == (1, 2)


def test_residuals_and_logits_equal_hf(model, tokens):
    oracle.check_residuals_against_hf(model, tokens)


def test_identities(model, cache):
    oracle.check_identities(model, cache)


def _mla(model, layer, resid_pre):
    """q, k, v, pattern, z of one layer from its weights: the low-rank query, the latent and the
    shared rotary key, each head's key / value decompressed by ``kv_b_proj``."""
    block = model.hf.model.layers[layer]
    attn, config = block.self_attn, model.hf.config
    nope, rope, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    x = block.input_layernorm(resid_pre)
    b, p, _ = x.shape
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, p, -1, nope + rope).transpose(1, 2)
    latent, k_rot = attn.kv_a_proj_with_mqa(x).split([config.kv_lora_rank, rope], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(b, p, -1, nope + dv).transpose(1, 2)
    k_nope, v = kv.split([nope, dv], dim=-1)
    cos, sin = model.hf.model.rotary_emb(x, torch.arange(p)[None])
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb_interleave
    q_rot, k_rot = rotary(q[..., nope:], k_rot.view(b, 1, p, rope), cos, sin)
    q = torch.cat([q[..., :nope], q_rot], -1)
    k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], -1)
    scores = (q @ k.transpose(2, 3)) * attn.scaling
    pattern = scores.masked_fill(torch.ones(p, p, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    return {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2), "pattern": pattern,
            "z": (pattern @ v).transpose(1, 2)}


def test_latent_attention_by_hand(model, cache):
    assert model.hf.config.rope_interleave
    for layer in range(model.info.n_layers):
        with torch.no_grad():
            want = _mla(model, layer, cache.get("resid_pre", layer))
            for site in ("q", "k", "v", "pattern", "z"):
                assert_near(cache.get(site, layer), want[site], f"{site}.{layer}", REL_SAME)
            k = cache.get("k", layer)[..., model.hf.config.qk_nope_head_dim:]
            assert torch.equal(k, k[:, :, :1].expand_as(k)), "one rotary key shared by every head"
            projected = model.hf.model.layers[layer].self_attn.o_proj(cache.get("z", layer).flatten(-2))
        assert_near(cache.get("attn_out", layer), projected, f"attn_out.{layer}", REL_SAME)
        assert_near(head_contributions(model, cache, layer).sum(2), projected, f"heads.{layer}", REL_SAME)


def test_pattern_equals_hf_attentions(model, tiny_path, tokens):
    oracle.check_pattern_against_hf(model, tiny_path("deepseek_v3"), tokens)


def _route(gate, x, config):
    """Sigmoid scores; the correction bias picks the top group(s) and the top-k inside them; the
    weights are the picked scores (without the bias), renormalised, times the scaling factor."""
    scores = F.linear(x, gate.weight).sigmoid()
    choice = scores + gate.e_score_correction_bias
    groups = choice.view(-1, config.n_group, config.n_routed_experts // config.n_group)
    best = groups.topk(2, dim=-1).values.sum(-1).topk(config.topk_group, dim=-1).indices
    keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(1, best, True)
    choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    ids = choice.topk(config.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * config.routed_scaling_factor


def test_router_and_experts_by_hand(model, cache):
    config = model.hf.config
    bias = model.hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert config.routed_scaling_factor != 1 and bias.abs().max() > 0  # the rule's parts show
    for layer in (1, 2):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            x = block.post_attention_layernorm(cache.get("resid_mid", layer))[0]
            ids, weights = _route(block.mlp.gate, x, config)
            assert_near(cache.get("router_logits", layer)[0], F.linear(x, block.mlp.gate.weight), "logits", REL_SAME)
            got_ids, got_w = cache.get("expert_indices", layer)[0], cache.get("expert_weights", layer)[0]
            assert torch.equal(got_ids.sort(-1).values, ids.sort(-1).values)
            assert_near(got_w.gather(-1, got_ids.argsort(-1)), weights.gather(-1, ids.argsort(-1)), "w", REL_SAME)
            experts = block.mlp.experts
            routed = torch.stack([sum(w * F.linear(experts.act_fn(g) * u, experts.down_proj[e])
                                      for e, w in zip(ids[t], weights[t])
                                      for g, u in [F.linear(x[t], experts.gate_up_proj[e]).chunk(2)])
                                  for t in range(x.shape[0])])
            want = routed + block.mlp.shared_experts(x)
        assert_near(cache.get("mlp_out", layer)[0], want, f"mlp_out.{layer}", REL_SAME)


def test_dense_first_layer_mlp_post_and_moe_layers_refuse_it(model, cache, tokens):
    block = model.hf.model.layers[0]
    with torch.no_grad():
        x = block.post_attention_layernorm(cache.get("resid_mid", 0))
        assert_near(cache.get("mlp_post", 0), block.mlp.act_fn(block.mlp.gate_proj(x)) * block.mlp.up_proj(x),
                    "mlp_post.0", REL_SAME)
    with pytest.raises(AddressError, match="layer 1 of .* is an MoE layer"):
        run_with_cache(model, tokens, ["mlp_post.1"])
    with pytest.raises(AddressError, match="out of range"):
        run_with_cache(model, tokens, ["router_logits.0"])


def test_edits_by_hand(model, tokens):
    oracle.check_edits_by_hand(model, tokens, "self_attn")


def test_q_k_edits_take_the_query_key_width(model, tokens):
    """A ``[d_head_qk]`` vector edits one head's key at one position (the same vector added to
    every key would leave the softmax as it was); a ``[d_head]`` one is refused for ``k``."""
    width = model.info.d_head_qk
    edit = Add(torch.ones(width), heads=[0], positions=[2], scale=3.0)
    got = run_with_cache(model, tokens, ["logits"], edits={"k.1": edit})["logits"]
    assert (got - run_with_cache(model, tokens, ["logits"])["logits"]).abs().max() > 1e-4
    with pytest.raises(InputError, match=str(width)):
        run_with_cache(model, tokens, ["logits"], edits={"k.1": Add(torch.ones(model.info.d_head), heads=[0])})
    run_with_cache(model, tokens, ["logits"], edits={"v.1": Zero(heads=[1])})


def test_positions(model, tokens):
    oracle.check_positions(model, tokens, ["resid_post.1", "z.2", "q.0", "pattern.0", "expert_indices.1", "logits"])
