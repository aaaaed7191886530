"""GPT-NeoX (Pythia) on the eager backend, with ``use_parallel_residual`` True and False, against
independent oracles: Hugging Face's ``output_hidden_states`` / ``output_attentions`` and the layer
written out by hand from the weights, partial rotary included (tests/gpt_oracles.py). Tolerance:
1e-5 relative (fp32).

With the parallel residual, attention and the MLP both read ``resid_pre``: ``resid_mid`` does not
exist and is refused with that reason, and ``resid_post = resid_pre + attn_out + mlp_out``. With
the sequential block ``resid_mid`` is served. Which record a model takes is decided by a test on
its config (the same ``model_type``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from interp_engine import Add, AddressError, Scale, head_contributions, logit_attribution, logit_lens, run_with_cache

from .. import gpt_oracles, tiny_gpt
from ..oracles import REL_SAME, assert_near

PROMPT = "Pythia reads the pile"
SITES = ("resid_pre", "q", "k", "v", "z", "pattern", "attn_out", "attn_out_post", "mlp_post", "mlp_out", "mlp_out_post",
         "resid_post")


@pytest.fixture(scope="module", params=["gpt_neox", "gpt_neox_sequential"])
def name(request):
    return request.param


@pytest.fixture(scope="module")
def pair(name, tiny_root):
    """(eager model, the same weights as a plain transformers model with eager attention)."""
    from interp_engine import load_model

    path = tiny_gpt.build(name, tiny_root)
    return load_model(str(path), backend="eager"), AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager").eval()


def _sites(model) -> list[str]:
    return list(SITES) + ([] if model.hf.config.use_parallel_residual else ["resid_mid"])


@pytest.fixture(scope="module")
def cache(pair):
    model, _ = pair
    return run_with_cache(model, model.to_tokens(PROMPT),
                          [f"{s}.{L}" for L in range(model.n_layers) for s in _sites(model)] + ["logits"])


def test_the_config_decides_the_record_and_what_is_served(pair):
    model, hf = pair
    parallel = hf.config.use_parallel_residual
    assert model.info.family == ("gpt_neox" if parallel else "gpt_neox_sequential")
    assert (model.d_mlp, model.d_head, model.info.n_kv_heads) == (512, 64, 4)
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.25  # rotary on 16 of 64 features
    names = {a.name for a in model.points()}
    assert ("resid_mid" in names) is not parallel
    if parallel:
        with pytest.raises(AddressError, match="use_parallel_residual=True attention and the MLP both read resid_pre"):
            run_with_cache(model, model.to_tokens(PROMPT), ["resid_mid.0"])
        with pytest.raises(AddressError, match="no residual stream exists between them"):
            run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.0"], edits={"resid_mid.0": Scale(2.0)})


def test_residuals_and_pattern_equal_hugging_faces_outputs(pair, cache):
    model, hf = pair
    with torch.no_grad():
        out = hf(cache.tokens, output_hidden_states=True, output_attentions=True)
    n = model.n_layers
    for L in range(n):
        assert_near(cache.get("resid_pre", L), out.hidden_states[L], f"resid_pre.{L}", REL_SAME)
        assert_near(cache.get("pattern", L), out.attentions[L], f"pattern.{L}", REL_SAME)
    assert_near(model.final_norm(cache.get("resid_post", n - 1)), out.hidden_states[n], "final norm", REL_SAME)
    assert_near(cache["logits"], out.logits, "logits", REL_SAME)


def test_every_site_equals_the_layer_by_hand(pair, cache):
    model, hf = pair
    with torch.no_grad():
        for L in range(model.n_layers):
            want = gpt_oracles.neox_layer(hf, L, cache.get("resid_pre", L))
            for site in _sites(model):
                assert_near(cache.get(site, L), want[site], f"{site}.{L}", REL_SAME)


def test_the_block_identities(pair, cache):
    model, _ = pair
    for L in range(model.n_layers):
        pre, attn, mlp, post = (cache.get(s, L) for s in ("resid_pre", "attn_out", "mlp_out", "resid_post"))
        assert_near(pre + attn + mlp, post, f"resid_post.{L}", REL_SAME)
        if "resid_mid" in _sites(model):
            assert_near(pre + attn, cache.get("resid_mid", L), f"resid_mid.{L}", REL_SAME)


def test_an_attn_out_edit_reaches_the_mlp_only_in_a_sequential_block(pair):
    """In a parallel block the MLP reads resid_pre, so editing attn_out leaves that layer's
    mlp_out as it was (and still moves resid_post by the edit)."""
    model, hf = pair
    tokens = model.to_tokens(PROMPT)
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(3))
    clean = run_with_cache(model, tokens, ["mlp_out.1", "resid_post.1"])
    edited = run_with_cache(model, tokens, ["mlp_out.1", "resid_post.1"], edits={"attn_out.1": Add(vector)})
    moved = (edited["mlp_out.1"] - clean["mlp_out.1"]).abs().max()
    if hf.config.use_parallel_residual:
        assert moved == 0
        assert_near(edited["resid_post.1"] - clean["resid_post.1"], vector.expand_as(clean["resid_post.1"]),
                    "resid_post moved by the edit", 1e-5)
    else:
        assert moved > 1e-3


def test_edits_equal_hand_written_hooks(pair):
    model, hf = pair
    tokens = model.to_tokens(PROMPT)
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(4))

    def add(module, args, out):
        return (out[0] + vector, *out[1:])

    got = run_with_cache(model, tokens, ["logits"], edits={"attn_out.0": Add(vector, positions=None)})["logits"]
    handle = hf.gpt_neox.layers[0].attention.register_forward_hook(add)
    try:
        with torch.no_grad():
            want = hf(tokens).logits
    finally:
        handle.remove()
    assert_near(got, want, "attn_out.0 edit", REL_SAME)


def test_head_contributions_logit_attribution_and_the_lens(pair, cache):
    model, hf = pair
    L = model.n_layers - 1
    dense = hf.gpt_neox.layers[L].attention.dense
    assert_near(head_contributions(model, cache, L).sum(2) + dense.bias, cache.get("attn_out", L), "heads", REL_SAME)
    full = run_with_cache(model, cache.tokens, ["resid_pre.0", "attn_out_post", "mlp_out_post", "resid_post", "logits"],
                          positions=-1)
    token = int(full["logits"][0, -1].argmax())
    shares = logit_attribution(model, full, token)
    bias = hf.gpt_neox.final_layer_norm.bias @ model.unembed_weight()[token]
    assert_near(shares.sum(0) + bias, full["logits"][..., token], "shares + final norm bias", REL_SAME)
    assert_near(logit_lens(model, full, layers=[L])[0], full["logits"], "lens", REL_SAME)


def test_positions_select_the_rows_of_the_full_capture(pair):
    model, _ = pair
    tokens = model.to_tokens(PROMPT)
    points = ["resid_pre.1", "z.0", "mlp_post.2", "pattern.1"]
    full = run_with_cache(model, tokens, points)
    some = run_with_cache(model, tokens, points, positions=[0, -1])
    last = tokens.shape[1] - 1
    for point in points:
        axis = 2 if point.startswith("pattern") else 1
        assert_near(some[point], full[point].index_select(axis, torch.tensor([0, last])), point, REL_SAME)
