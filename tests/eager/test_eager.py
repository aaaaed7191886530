"""Eager backend, every dense family: each site checked against an independent oracle —
HF ``output_hidden_states``, HF eager attention weights, the model's own modules applied to
the captured inputs — and the residual identities of the address contract."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from interp_engine import Address, head_contributions, run_with_cache
from interp_engine.compare import relative_error

from ..tiny import DENSE_FAMILIES
from ..devices import load_kwargs, on
from ..oracles import REL_SAME, assert_near

PROMPT = "The quick brown fox jumps"
LAYERS = range(3)
DENSE = ["resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post", "resid_post", "z", "q", "k",
         "v", "mlp_post"]


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
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
    return run_with_cache(model, tokens, [f"{n}.{l}" for n in DENSE for l in LAYERS] + ["logits"])


def layer(model, i):
    return model.hf.model.layers[i]


def test_resid_post_is_hf_hidden_state(model, tokens):
    cache = run_with_cache(model, tokens, [Address("resid_post", l) for l in LAYERS] + ["resid_pre.0"])
    ref = model.hf(input_ids=on(model, tokens), output_hidden_states=True).hidden_states
    assert torch.equal(cache.get("resid_pre", 0), ref[0])
    for l in LAYERS[:-1]:  # HF's last hidden state has the final norm applied
        assert torch.equal(cache.get("resid_post", l), ref[l + 1])
    final = model.hf.get_submodule(model.arch.final_norm)(cache.get("resid_post", 2))
    torch.testing.assert_close(final, ref[3], rtol=0, atol=1e-6)


def test_residual_identities(cache):
    for l in LAYERS:
        torch.testing.assert_close(cache.get("resid_mid", l), cache.get("resid_pre", l) + cache.get("attn_out_post", l),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.get("resid_post", l), cache.get("resid_mid", l) + cache.get("mlp_out_post", l),
                                   atol=1e-5, rtol=0)
        if l + 1 in LAYERS:
            assert torch.equal(cache.get("resid_post", l), cache.get("resid_pre", l + 1))


def test_logits_equal_hf(model, tokens, cache):
    ref = model.hf(input_ids=on(model, tokens)).logits
    assert torch.equal(cache["logits"], ref)


def test_z_through_output_projection_is_attn_out(model, family, cache):
    for l in LAYERS:
        attn = layer(model, l).self_attn
        out = attn.o_proj(cache.get("z", l).flatten(-2))
        torch.testing.assert_close(out, cache.get("attn_out", l), atol=1e-5, rtol=1e-5)
        if family == "gemma2":
            out = layer(model, l).post_attention_layernorm(out)
        torch.testing.assert_close(out, cache.get("attn_out_post", l), atol=1e-5, rtol=1e-5)


def test_head_contributions_sum_to_projection(model, cache):
    for l in LAYERS:
        heads = head_contributions(model, cache, l)
        assert heads.shape == (1, cache.tokens.shape[1], model.n_heads, model.d_model)
        o_proj = layer(model, l).self_attn.o_proj
        bias = o_proj.bias if o_proj.bias is not None else 0
        torch.testing.assert_close(heads.sum(2) + bias, o_proj(cache.get("z", l).flatten(-2)), atol=1e-5, rtol=1e-5)


def test_mlp_post_through_down_projection_is_mlp_output(model, family, cache):
    for l in LAYERS:
        out = layer(model, l).mlp.down_proj(cache.get("mlp_post", l))
        torch.testing.assert_close(out, cache.get("mlp_out", l), atol=1e-5, rtol=1e-5)
        if family == "gemma2":
            out = layer(model, l).post_feedforward_layernorm(out)
        torch.testing.assert_close(out, cache.get("mlp_out_post", l), atol=1e-5, rtol=1e-5)


def test_mlp_post_is_activation_of_normed_resid_mid(model, family, cache):
    mlp_norm = "pre_feedforward_layernorm" if family == "gemma2" else "post_attention_layernorm"
    for l in LAYERS:
        block = layer(model, l)
        x = getattr(block, mlp_norm)(cache.get("resid_mid", l))
        torch.testing.assert_close(cache.get("mlp_post", l), _gated(block.mlp, x), atol=1e-5, rtol=1e-5)


def _gated(mlp, x):
    """The gated MLP's hidden activation, written out by hand."""
    if hasattr(mlp, "gate_up_proj"):  # Phi-3 fuses the gate and up projections
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        return mlp.activation_fn(gate) * up
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def test_pattern_matches_hf_eager_attention(model, tiny_path, family, tokens):
    hf_eager = AutoModelForCausalLM.from_pretrained(tiny_path(family), attn_implementation="eager").to(model.device)
    ref = hf_eager(input_ids=on(model, tokens), output_attentions=True).attentions
    cache = run_with_cache(model, tokens, [Address("pattern", l) for l in LAYERS])
    for l in LAYERS:
        pattern = cache.get("pattern", l)
        assert pattern.shape == (1, model.n_heads, tokens.shape[1], tokens.shape[1])
        torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1], device=pattern.device), atol=1e-5, rtol=0)
        assert torch.equal(pattern.triu(1), torch.zeros_like(pattern))  # causal
        torch.testing.assert_close(pattern, ref[l], atol=1e-6, rtol=1e-5)


def test_z_is_pattern_times_v(model, tokens):
    cache = run_with_cache(model, tokens, [f"{n}.{l}" for n in ("pattern", "v", "z") for l in LAYERS])
    groups = model.n_heads // model.info.n_kv_heads
    for l in LAYERS:
        v = cache.get("v", l).repeat_interleave(groups, dim=2)  # [b, k, h, d]
        z = torch.einsum("bhqk,bkhd->bqhd", cache.get("pattern", l), v)
        torch.testing.assert_close(z, cache.get("z", l), atol=1e-5, rtol=1e-5)


def _rotate(x, cos, sin):
    """Rotary embedding written out (``[b, h, p, d]``; the first ``cos.shape[-1]`` dims rotate)."""
    rot = cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    half = torch.cat([-x[..., rot // 2:], x[..., : rot // 2]], -1)
    return torch.cat([x * cos[:, None] + half * sin[:, None], rest], -1)


def test_q_k_are_the_projections_after_rotary_by_hand(model, cache):
    """``q`` / ``k`` of every family from the layer's weights: the input norm, the projections (Phi-3's
    fused ``qkv_proj`` split by hand, Qwen2's biases included), Qwen3's per-head norms, and the
    rotation written out with the model's own cos / sin tables."""
    n = cache.tokens.shape[1]
    cos, sin = model.hf.model.rotary_emb(cache.get("resid_pre", 0), torch.arange(n, device=model.device)[None])
    for l in LAYERS:
        attn = layer(model, l).self_attn
        x = layer(model, l).input_layernorm(cache.get("resid_pre", l))
        if hasattr(attn, "qkv_proj"):
            q, k, _ = attn.qkv_proj(x).split([model.n_heads * model.d_head, model.info.n_kv_heads * model.d_head,
                                              model.info.n_kv_heads * model.d_head], -1)
        else:
            q, k = attn.q_proj(x), attn.k_proj(x)
        q, k = q.unflatten(-1, (-1, model.d_head)), k.unflatten(-1, (-1, model.d_head))
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        for site, want in (("q", q), ("k", k)):
            rotated = _rotate(want.transpose(1, 2), cos, sin).transpose(1, 2)
            assert relative_error(rotated, want) > 1e-2, "the rotation must show"
            assert_near(cache.get(site, l), rotated, f"{site}.{l}", REL_SAME)


def test_q_k_form_the_scores(model, tokens):
    """The pattern from ``q`` / ``k`` with each family's scores written out from its config: the
    scale (Gemma 2: ``query_pre_attn_scalar``), the attention softcapping (Gemma 2) and the sliding
    window (Mistral; Gemma 2's sliding layers) — each shown to matter in test_must_change.py."""
    config = model.hf.config
    cache = run_with_cache(model, tokens, [f"{n}.{l}" for n in ("pattern", "q", "k") for l in LAYERS])
    groups = model.n_heads // model.info.n_kv_heads
    n = tokens.shape[1]
    i, j = torch.arange(n, device=model.device)[:, None], torch.arange(n, device=model.device)[None]
    scale = getattr(config, "query_pre_attn_scalar", None) or model.d_head
    cap = getattr(config, "attn_logit_softcapping", None)
    window, kinds = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    for l in LAYERS:
        q, k = cache.get("q", l), cache.get("k", l).repeat_interleave(groups, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale**-0.5
        if cap:
            scores = torch.tanh(scores / cap) * cap
        allowed = j <= i
        if window and (kinds is None or kinds[l] == "sliding_attention"):
            allowed = allowed & (j > i - window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(scores.softmax(-1), cache.get("pattern", l), atol=1e-5, rtol=1e-5)


def test_padded_batch_equals_single_prompts(model):
    prompts = ["The quick brown fox", "Hi", "Lorem ipsum dolor sit amet"]
    points = ["resid_post.1", "z.2", "mlp_post.0", "q.1", "logits", "pattern.1"]
    tokens = model.tok.to_tokens(prompts)
    batch = run_with_cache(model, tokens, points)
    assert batch.mask.tolist() == (tokens >= 0).tolist()
    for i, prompt in enumerate(prompts):
        single = run_with_cache(model, model.to_tokens(prompt), points)
        n = single.tokens.shape[1]
        for a in single:
            got = batch[a][i, :, :n, :n] if a.name == "pattern" else batch[a][i, :n]
            torch.testing.assert_close(got, single[a][0], atol=1e-5, rtol=1e-5)
            padded = batch[a][i, :, n:] if a.name == "pattern" else batch[a][i, n:]
            assert not padded.any(), f"{a} has data at padded positions"


def test_gradients_match_plain_hf(tiny_path):
    from interp_engine import load_model

    model = load_model(str(tiny_path("llama")), backend="eager", requires_grad=True, **load_kwargs())
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, ["resid_post.1"], detach=False)
    (cache.get("resid_post", 1) ** 2).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.hf.named_parameters() if p.grad is not None}
    model.hf.zero_grad(set_to_none=True)
    hidden = model.hf(input_ids=on(model, tokens), output_hidden_states=True).hidden_states[2]
    (hidden**2).sum().backward()
    theirs = {n: p.grad for n, p in model.hf.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys() and "model.embed_tokens.weight" in ours
    for n in ours:
        torch.testing.assert_close(ours[n], theirs[n], atol=1e-6, rtol=1e-5)
