"""MoE routing on the eager backend, checked against the Hugging Face modules themselves.

Oracles: the gate weight applied to the layer's normed input (computed here), transformers' own
``output_router_logits``, and the ``(top_k_index, top_k_weights)`` that each MoE block hands to
its experts module (read with a hook of the test's own), top-k ties included.
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import Address, AddressError, RoutingError, expert_assignment, load_model, run_with_cache

from ..devices import load_kwargs, on
from ..oracles import assert_near

from .. import tiny_moe

PROMPTS = ["Hello there, experts", "Hi"]
ROUTED = ("qwen3_moe", "olmoe", "mixtral")  # softmax-top-k routers with output_router_logits
SOFTMAX = (*ROUTED, "qwen4_exp")  # softmax, top-k, renormalised when norm_topk_prob
ALL = tiny_moe.MOE_FAMILIES


def _layer(model, layer):
    return model.hf.model.layers[layer]


def _experts_input(model, layer):
    """Hook the experts module of ``layer`` and return the list its inputs are appended to."""
    seen = []

    def hook(module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        seen.append((values["top_k_index"].clone(), values["top_k_weights"].clone()))

    handle = _layer(model, layer).mlp.experts.register_forward_pre_hook(hook, with_kwargs=True)
    return seen, handle


def _flat_real(cache, address):
    """``[batch, pos, ...]`` -> the real (unpadded) rows, in batch-major order."""
    return cache[address][cache.mask]


@pytest.mark.parametrize("family", ROUTED)
def test_router_logits_are_the_gate_on_the_layer_input(eager_models, family):
    model = eager_models(family)
    layer = model.info.moe_layers[-1]
    tokens = model.to_tokens(PROMPTS)
    cache = run_with_cache(model, tokens, [f"router_logits.{layer}", f"resid_mid.{layer}"])
    logits = cache.get("router_logits", layer)
    assert logits.shape == (*tokens.shape, model.info.n_experts)

    block = _layer(model, layer)
    with torch.no_grad():
        expected = block.post_attention_layernorm(cache.get("resid_mid", layer)) @ block.mlp.gate.weight.T
        hf = model.hf(input_ids=on(model, tokens.clamp(min=0)), attention_mask=on(model, tokens >= 0),
                      output_router_logits=True)
    real = cache.mask
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-5, atol=1e-5)
    # transformers' own record of the gate output (one entry per MoE layer, flat tokens)
    own = hf.router_logits[model.info.moe_layers.index(layer)].reshape(*tokens.shape, -1)
    torch.testing.assert_close(logits[real], own[real], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ALL)
def test_selection_is_what_the_experts_consumed(eager_models, family):
    model = eager_models(family)
    tokens = model.to_tokens(PROMPTS)
    layers = model.info.moe_layers
    points = [f"{n}.{L}" for L in layers for n in ("expert_weights", "expert_indices")]
    hooks = {L: _experts_input(model, L) for L in layers}
    try:
        cache = run_with_cache(model, tokens, points)
    finally:
        for _, handle in hooks.values():
            handle.remove()
    for L in layers:
        (index, weight), = hooks[L][0]
        assert cache.get("expert_indices", L).shape == (*tokens.shape, model.info.top_k)
        assert torch.equal(cache.get("expert_indices", L)[cache.mask], index.reshape(*tokens.shape, -1)[cache.mask])
        assert torch.equal(cache.get("expert_weights", L)[cache.mask], weight.reshape(*tokens.shape, -1)[cache.mask])


@pytest.mark.parametrize("family", SOFTMAX)
def test_selection_follows_the_family_rule(eager_models, family):
    """Independently of the module: the selected experts are a top-k of the softmax, and the
    weights are their probabilities, renormalised exactly when the config says so."""
    model = eager_models(family)
    config = model.hf.config
    renormalize = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalises
    layer = model.info.moe_layers[0]
    cache = run_with_cache(model, model.to_tokens(PROMPTS), [f"{n}.{layer}" for n in
                                                             ("router_logits", "expert_weights", "expert_indices")])
    probs = torch.softmax(_flat_real(cache, Address("router_logits", layer)).double(), dim=-1)
    index = _flat_real(cache, Address("expert_indices", layer))
    weight = _flat_real(cache, Address("expert_weights", layer)).double()
    chosen = probs.gather(-1, index)
    unchosen = probs.scatter(-1, index, float("-inf"))
    assert (chosen.min(-1).values >= unchosen.max(-1).values).all()
    assert all(len(set(r.tolist())) == len(r) for r in index)
    expected = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6)


def test_tied_router_scores_keep_the_modules_selection(tiny_path):
    """Every expert scores the same: the top-k is a pure tie. The captured selection is still
    the one the experts received, k distinct experts each weighted 1/k."""
    model = load_model(str(tiny_path("qwen3_moe")), backend="eager", **load_kwargs())
    layer = model.info.moe_layers[0]
    gate = _layer(model, layer).mlp.gate
    with torch.no_grad():
        gate.weight.copy_(gate.weight[:1].expand_as(gate.weight))
    seen, handle = _experts_input(model, layer)
    try:
        cache = run_with_cache(model, model.to_tokens(PROMPTS), [f"expert_indices.{layer}", f"expert_weights.{layer}"])
    finally:
        handle.remove()
    index = _flat_real(cache, Address("expert_indices", layer))
    (own_index, own_weight), = seen
    assert torch.equal(index, own_index.reshape(*cache.tokens.shape, -1)[cache.mask])
    assert all(len(set(row.tolist())) == model.info.top_k for row in index)
    k = model.info.top_k
    torch.testing.assert_close(_flat_real(cache, Address("expert_weights", layer)), torch.full_like(index, 1 / k,
                                                                                                   dtype=torch.float32))
    dense = expert_assignment(cache, layer, model.info.n_experts)
    assert ((dense != 0).sum(-1)[cache.mask] == k).all()


@pytest.mark.parametrize("family", ALL)
def test_expert_assignment_from_the_selection(eager_models, family):
    model = eager_models(family)
    info = model.info
    tokens = model.to_tokens(PROMPTS)
    points = [f"{n}.{L}" for L in info.moe_layers for n in ("router_logits", "expert_weights", "expert_indices")]
    cache = run_with_cache(model, tokens, points)
    for L in info.moe_layers:
        dense = expert_assignment(cache, L, info.n_experts)
        assert dense.shape == (*tokens.shape, info.n_experts)
        assert ((dense != 0).sum(-1) <= info.top_k).all()
        assert (dense[~cache.mask] == 0).all()
        # every selected (index, weight) pair is where the dense tensor puts it
        index, weight = cache.get("expert_indices", L), cache.get("expert_weights", L)
        distinct = all(len(set(r.tolist())) == len(r) for r in index[cache.mask])
        if distinct:
            torch.testing.assert_close(dense.gather(-1, index), weight)
        sums = dense.sum(-1)[cache.mask].double()
        config = model.hf.config
        if family in ("deepseek_v4", "hy_v4"):
            expected = torch.full_like(sums, config.routed_scaling_factor)  # renormalised, then scaled
        elif getattr(config, "norm_topk_prob", True):
            expected = torch.ones_like(sums)
        else:  # OLMoE: the top-k softmax mass, computed here from the gate output
            probs = torch.softmax(cache.get("router_logits", L)[cache.mask].double(), -1)
            expected = probs.topk(info.top_k, -1).values.sum(-1)
        torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", SOFTMAX)
def test_expert_assignment_from_router_logits_applies_the_named_rule(eager_models, family):
    model = eager_models(family)
    info = model.info
    renormalize = getattr(model.hf.config, "norm_topk_prob", True)
    layer = info.moe_layers[0]
    full = run_with_cache(model, model.to_tokens(PROMPTS), [f"{n}.{layer}" for n in
                                                            ("router_logits", "expert_weights", "expert_indices")])
    logits_only = run_with_cache(model, model.to_tokens(PROMPTS), [f"router_logits.{layer}"])
    with pytest.raises(RoutingError, match="top_k=.*renormalize="):
        expert_assignment(logits_only, layer, info.n_experts)
    derived = expert_assignment(logits_only, layer, info.n_experts, top_k=info.top_k, renormalize=renormalize)
    torch.testing.assert_close(derived, expert_assignment(full, layer, info.n_experts), rtol=1e-5, atol=1e-6)


def test_seed_moe_example_runs_as_written(tiny_path):
    """The seed's "MoE routing" example, with the tiny 128-expert Qwen3-MoE in place of Qwen3-30B-A3B."""
    name = str(tiny_path("qwen3_moe"))
    from interp_engine import expert_assignment, load_model, run_with_cache

    model = load_model(name, backend="eager", **load_kwargs())
    cache = run_with_cache(
        model,
        model.to_tokens("Hello"),
        ["router_logits.10", "expert_weights.10", "expert_indices.10"],
    )
    dense = expert_assignment(cache, 10, n_experts=128)  # [batch, pos, n_experts]

    assert dense.shape == (1, cache.tokens.shape[1], 128)
    torch.testing.assert_close(dense.sum(-1), torch.ones(1, cache.tokens.shape[1], device=dense.device))


def test_batched_routing_matches_single_prompts(eager_models):
    """Router outputs are flat over batch*pos; a padded batch must land each row on its prompt."""
    model = eager_models("qwen3_moe")
    layer = 3
    points = [f"router_logits.{layer}", f"expert_indices.{layer}"]
    batch = run_with_cache(model, model.to_tokens(PROMPTS), points)
    for row, prompt in enumerate(PROMPTS):
        single = run_with_cache(model, model.to_tokens(prompt), points)
        n = single.tokens.shape[1]
        torch.testing.assert_close(batch.get("router_logits", layer)[row, :n], single.get("router_logits", layer)[0],
                                   rtol=1e-4, atol=1e-5)
        assert torch.equal(batch.get("expert_indices", layer)[row, :n], single.get("expert_indices", layer)[0])


def test_routing_while_generating(eager_models):
    from interp_engine import capture_generation

    model = eager_models("qwen3_moe")
    tokens = model.to_tokens("Hi")
    completion, cache = capture_generation(model, tokens, ["router_logits.1", "expert_indices.1"], max_tokens=3,
                                           stop_at_eos=False)
    n = tokens.shape[1] + len(completion.token_ids) - 1
    assert cache.get("router_logits", 1).shape == (1, n, 128)
    assert cache.get("expert_indices", 1).shape == (1, n, 8)
    plain = run_with_cache(model, cache.tokens, ["router_logits.1"])
    torch.testing.assert_close(cache.get("router_logits", 1), plain.get("router_logits", 1), rtol=1e-4, atol=1e-5)


# -- bad inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("site", ["router_logits", "expert_weights", "expert_indices"])
def test_moe_sites_on_a_dense_model_say_so(eager_models, site):
    model = eager_models("llama")
    with pytest.raises(AddressError, match="dense model and has no MoE router; valid sites: .*resid_post"):
        run_with_cache(model, model.to_tokens("Hi"), [f"{site}.0"])


def test_moe_sites_on_a_dense_layer_list_the_moe_layers(eager_models):
    model = eager_models("qwen3_moe")
    with pytest.raises(AddressError, match=r"layer 0 is out of range.*\[1, 2, .*10\]"):
        run_with_cache(model, model.to_tokens("Hi"), ["router_logits.0"])


def test_mlp_post_on_an_moe_layer_points_to_the_routing(eager_models):
    model = eager_models("qwen3_moe")
    with pytest.raises(AddressError, match=r"MoE layer.*dense layers \[0\].*router_logits"):
        run_with_cache(model, model.to_tokens("Hi"), ["mlp_post.1"])
    assert run_with_cache(model, model.to_tokens("Hi"), ["mlp_post.0"]).get("mlp_post", 0).shape[-1] == 256


def test_n_experts_not_matching_the_model(eager_models):
    model = eager_models("qwen3_moe")
    cache = run_with_cache(model, model.to_tokens("Hi"), ["router_logits.1", "expert_weights.1", "expert_indices.1"])
    with pytest.raises(RoutingError, match="n_experts=64 does not match the model.*Pass n_experts=128"):
        expert_assignment(cache, 1, n_experts=64)
    selection_only = run_with_cache(model, model.to_tokens("Hi"), ["expert_weights.1", "expert_indices.1"])
    small = int(selection_only.get("expert_indices", 1).max())
    with pytest.raises(RoutingError, match=f"holds expert {small} but n_experts={small}"):
        expert_assignment(selection_only, 1, n_experts=small)
    with pytest.raises(RoutingError, match="holds no routing for layer 2"):
        expert_assignment(cache, 2, n_experts=128)


def test_deepseek_v4_hash_and_bias_corrected_routing(eager_models):
    """DeepSeek-V4's two rules, recomputed here: a hash layer sends token t to ``tid2eid[t]``;
    a scored layer picks the top-k of sqrt(softplus(logits)) + correction bias and weights them by
    the renormalised scores (without the bias) times routed_scaling_factor."""
    model = eager_models("deepseek_v4")
    config = model.hf.config
    tokens = model.to_tokens(PROMPTS)
    cache = run_with_cache(model, tokens, [f"{n}.{L}" for L in (0, 1) for n in
                                           ("router_logits", "expert_weights", "expert_indices")])
    assert config.mlp_layer_types == ["hash_moe", "moe"]
    table = _layer(model, 0).mlp.gate.tid2eid
    assert torch.equal(cache.get("expert_indices", 0)[cache.mask], table[tokens[cache.mask]])

    bias = _layer(model, 1).mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0, "the tiny model's correction bias is randomised"
    scores = torch.sqrt(torch.nn.functional.softplus(_flat_real(cache, Address("router_logits", 1)).double()))
    index = _flat_real(cache, Address("expert_indices", 1))
    expected = (scores + bias.double()).topk(config.num_experts_per_tok, -1).indices
    assert torch.equal(index.sort(-1).values, expected.sort(-1).values)
    chosen = scores.gather(-1, index)
    torch.testing.assert_close(_flat_real(cache, Address("expert_weights", 1)).double(),
                               chosen / chosen.sum(-1, keepdim=True) * config.routed_scaling_factor)


def test_hy_v4_runs_transformers_own_eager_attention(eager_models, tiny_path):
    """HY-V4's modeling code applies the indexer's top-k mask and its attention sinks only under
    implementations literally named "eager" / "sdpa" (attention.NAME_BRANCHING): our capture must be
    transformers' own eager forward (an independent load of it), from layer 0's attention on."""
    from transformers import AutoModelForCausalLM

    model = eager_models("hy_v4")
    oracle = AutoModelForCausalLM.from_pretrained(str(tiny_path("hy_v4")), attn_implementation="eager",
                                                  dtype=torch.float32).to(model.device).eval()
    tokens = model.to_tokens(["Hello there, sparse attention with sinks and a top-k index"])
    seen = []
    handle = oracle.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    with torch.no_grad():
        want = oracle(input_ids=on(model, tokens)).logits
    handle.remove()
    cache = run_with_cache(model, tokens, ["attn_out.0", "logits"])
    assert_near(cache.get("attn_out", 0), seen[0], "HY-V4 attn_out.0 against transformers' eager attention", rel=1e-5)
    assert_near(cache.get("logits"), want, "HY-V4 logits against transformers' eager forward", rel=1e-5)
