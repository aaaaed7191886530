"""GPT-2 on the eager backend, against independent oracles: Hugging Face's own ``output_hidden_states``
and ``output_attentions``, and the layer written out by hand from the weights (tests/gpt_oracles.py,
which reads GPT-2's ``Conv1D`` weights as stored, ``[in, out]``). Tolerance: 1e-5 relative (fp32).

GPT-2 stores its projections transposed relative to ``nn.Linear``; ``head_contributions``,
``logit_attribution`` and edits of ``z`` must read them the right way round. The tiny model's
projections are square where it matters (``c_proj`` is 256 x 256), so a reader that took the wrong
layout would pass every shape check and fail these value checks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from interp_engine import (Add, Set, Zero, capture_generation, head_contributions, logit_attribution, logit_lens,
                           run_with_cache)
from interp_engine.archs import model_info

from .. import gpt_oracles, tiny_gpt
from ..oracles import REL_SAME, assert_near

PROMPT = "The quick brown fox"
SITES = ("resid_pre", "q", "k", "v", "z", "pattern", "attn_out", "attn_out_post", "resid_mid", "mlp_post", "mlp_out",
         "mlp_out_post", "resid_post")


@pytest.fixture(scope="module")
def path(tiny_root):
    return tiny_gpt.build("gpt2", tiny_root)


@pytest.fixture(scope="module")
def model(path):
    from interp_engine import load_model

    return load_model(str(path), backend="eager")


@pytest.fixture(scope="module")
def hf(path):
    """The same weights as a plain transformers model (eager attention: it forms the probabilities)."""
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def cache(model):
    return run_with_cache(model, model.to_tokens(PROMPT), [f"{s}.{L}" for L in range(model.n_layers) for s in SITES]
                          + ["logits"])


def test_the_record_and_the_dimensions_come_from_gpt2s_config(model, hf):
    assert model.info.family == "gpt2" and model.arch.weights == "in_out"
    block = hf.transformer.h[0]
    assert model.d_mlp == block.mlp.c_fc.weight.shape[1] == 4 * model.d_model  # n_inner unset: 4 * n_embd
    assert (model.n_heads, model.d_head, model.info.n_kv_heads) == (4, 64, 4)
    config = hf.config.__class__(**{**hf.config.to_dict(), "n_inner": 320})
    assert model_info(config, "x").d_mlp == 320
    # the output projection as nn.Linear holds it: [d_model, n_heads * d_head] = c_proj.weight transposed
    assert torch.equal(model.o_proj_weight(1), hf.transformer.h[1].attn.c_proj.weight.t())


def test_residuals_and_pattern_equal_hugging_faces_outputs(model, hf, cache):
    with torch.no_grad():
        out = hf(cache.tokens, output_hidden_states=True, output_attentions=True)
    n = model.n_layers
    for L in range(n):
        assert_near(cache.get("resid_pre", L), out.hidden_states[L], f"resid_pre.{L}", REL_SAME)
        assert_near(cache.get("pattern", L), out.attentions[L], f"pattern.{L}", REL_SAME)
    for L in range(n - 1):
        assert_near(cache.get("resid_post", L), out.hidden_states[L + 1], f"resid_post.{L}", REL_SAME)
    # HF's last hidden state is after ln_f
    assert_near(model.final_norm(cache.get("resid_post", n - 1)), out.hidden_states[n], "ln_f(resid_post)", REL_SAME)
    assert_near(cache["logits"], out.logits, "logits", REL_SAME)


def test_every_site_equals_the_layer_by_hand(model, hf, cache):
    with torch.no_grad():
        for L in range(model.n_layers):
            want = gpt_oracles.gpt2_layer(hf, L, cache.get("resid_pre", L))
            for site in SITES:
                assert_near(cache.get(site, L), want[site], f"{site}.{L}", REL_SAME)


def test_head_contributions_read_the_transposed_weight(model, hf, cache):
    L = 1
    per_head = head_contributions(model, cache, L)
    c_proj = hf.transformer.h[L].attn.c_proj
    z = cache.get("z", L)
    d = model.d_head
    for h in range(model.n_heads):  # head h's rows of the Conv1D weight [in, out]
        assert_near(per_head[:, :, h], z[:, :, h] @ c_proj.weight[h * d:(h + 1) * d], f"head {h}", REL_SAME)
    assert_near(per_head.sum(2) + c_proj.bias, cache.get("attn_out", L), "sum of heads + bias", REL_SAME)


def test_logit_attribution_sums_to_the_logit_less_the_ln_f_bias(model, hf, cache):
    """GPT-2's ln_f is a LayerNorm: the components are centred and scaled as it does at the final
    residual, and its bias adds ``ln_f.bias . W_U[t]`` on top of their shares."""
    target = cache.tokens[:, 1:]  # the next token at each position
    full = run_with_cache(model, cache.tokens, ["resid_pre.0", "attn_out_post", "mlp_out_post", "resid_post", "logits"])
    ids = torch.cat([target, target[:, -1:]], dim=1)
    shares = logit_attribution(model, full, ids)
    assert shares.shape == (1 + 2 * model.n_layers, *ids.shape)
    w_u = model.unembed_weight()
    bias = (hf.transformer.ln_f.bias * w_u[ids]).sum(-1)
    logit = full["logits"].gather(-1, ids[..., None])[..., 0]
    assert_near(shares.sum(0) + bias, logit, "shares + bias", REL_SAME)
    # per head: the heads' shares plus the projection bias's share are attn_out's share
    L = 2
    heads = head_contributions(model, cache, L).permute(2, 0, 1, 3)
    per_head = logit_attribution(model, full, ids, components=heads)
    bias_part = hf.transformer.h[L].attn.c_proj.bias.expand(1, *ids.shape, -1)
    c_bias = logit_attribution(model, full, ids, components=bias_part)
    assert_near(per_head.sum(0) + c_bias[0], shares[1 + 2 * L], "heads' shares", REL_SAME)


def test_the_logit_lens_at_the_last_layer_is_the_logits(model, cache):
    lens = logit_lens(model, cache, layers=[model.n_layers - 1])
    assert_near(lens[0], cache["logits"], "lens", REL_SAME)


def _hooked_logits(hf, tokens, module, hook, pre: bool):
    handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return hf(tokens).logits
    finally:
        handle.remove()


def test_edits_equal_hand_written_hooks(model, hf):
    tokens = model.to_tokens(PROMPT)
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(1))
    h, d = 2, model.d_head

    def zero_head(module, args):
        z = args[0].clone()
        z[..., h * d:(h + 1) * d] = 0
        return (z,)

    def add_to_attn(module, args, out):  # resid_mid = resid_pre + attn_out: adding to it adds to attn_out
        return (out[0] + 3.0 * vector, *out[1:])

    value = torch.randn(model.d_mlp, generator=torch.Generator().manual_seed(2))

    def set_neurons(module, args):
        x = args[0].clone()
        x[:, 3] = value
        return (x,)

    cases = [
        ({"z.1": Zero(heads=[h])}, hf.transformer.h[1].attn.c_proj, zero_head, True),
        ({"resid_mid.0": Add(vector, scale=3.0)}, hf.transformer.h[0].attn, add_to_attn, False),
        ({"mlp_post.2": Set(value, positions=[3])}, hf.transformer.h[2].mlp.c_proj, set_neurons, True),
    ]
    clean = run_with_cache(model, tokens, ["logits"])["logits"]
    for edits, module, hook, pre in cases:
        got = run_with_cache(model, tokens, ["logits"], edits=edits)["logits"]
        want = _hooked_logits(hf, tokens, module, hook, pre)
        assert_near(got, want, str(edits), REL_SAME)
        assert (got - clean).abs().max() > 1e-3, f"{edits} changed nothing"


def test_positions_and_padded_batches(model):
    tokens = model.to_tokens(PROMPT)
    full = run_with_cache(model, tokens, ["resid_post.1", "z.2"])
    last = run_with_cache(model, tokens, ["resid_post.1", "z.2"], positions=-1)
    for point in ("resid_post.1", "z.2"):
        assert_near(last[point][:, 0], full[point][:, -1], point, REL_SAME)
    batch = model.tok.to_tokens([PROMPT, "Hi"])
    both = run_with_cache(model, batch, ["resid_post.2"])
    alone = run_with_cache(model, model.to_tokens("Hi"), ["resid_post.2"])
    assert_near(both["resid_post.2"][1, : alone.tokens.shape[1]], alone["resid_post.2"][0], "padded row", REL_SAME)


def test_generation_is_hugging_faces_greedy_decode(model, hf):
    tokens = model.to_tokens(PROMPT)
    completion, cache = capture_generation(model, tokens, ["resid_post.1", "logits"], max_tokens=6)
    with torch.no_grad():
        want = hf.generate(tokens, max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=0)
    assert completion.token_ids == want[0, tokens.shape[1]:].tolist()
    with torch.no_grad():
        out = hf(cache.tokens, output_hidden_states=True)
    assert_near(cache.get("resid_post", 1), out.hidden_states[2], "resid_post.1 over prompt + generated", REL_SAME)
    assert_near(cache["logits"], out.logits, "logits over prompt + generated", REL_SAME)
