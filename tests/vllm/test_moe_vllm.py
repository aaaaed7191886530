"""MoE routing on the vLLM backend, against the eager backend and vLLM's own routing callback.

One engine per family (module-scoped, parametrised). ``router_logits`` is the gate's output;
``expert_weights`` / ``expert_indices`` are the pair the router's ``select_experts`` handed to
the expert kernel (see interp_engine/backends/vllm/worker/experts.py). The order of the top-k slots is each
engine's own, so selections are compared as sets, through ``expert_assignment``.
"""

from __future__ import annotations

import types

import pytest
import torch

from interp_engine import AddressError, capture_generation, expert_assignment, load_model, run_with_cache
from interp_engine.points import check_points
from interp_engine.backends.vllm.worker.experts import unreadable_sites

from .. import tiny_moe
from ..oracles import assert_near
from ..probes import engine_state

pytest.importorskip("vllm")

PROMPT = "Hello there, experts"


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_tiny_moe")


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe", "mixtral"])
def pair(request, moe_root):
    """(vllm model, eager model) of one MoE family, on the same weights."""
    path = str(tiny_moe.build(request.param, moe_root))
    model = load_model(path, backend="vllm", max_model_len=128)
    yield model, load_model(path, backend="eager")
    model.close()


def _routing_points(model):
    return [f"{n}.{L}" for L in model.info.moe_layers for n in ("router_logits", "expert_weights", "expert_indices")]


def test_router_logits_and_selection_match_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens(PROMPT)
    points = _routing_points(vllm)
    got, want = run_with_cache(vllm, tokens, points), run_with_cache(eager, tokens, points)
    info = vllm.info
    for L in info.moe_layers:
        assert_near(got.get("router_logits", L), want.get("router_logits", L), f"router_logits.{L}")
        indices = got.get("expert_indices", L)
        assert indices.dtype == want.get("expert_indices", L).dtype == torch.int64
        assert torch.equal(indices.sort(-1).values, want.get("expert_indices", L).sort(-1).values), f"experts of {L}"
        dense, oracle = expert_assignment(got, L, info.n_experts), expert_assignment(want, L, info.n_experts)
        assert_near(dense, oracle, f"expert_assignment at {L}")


def test_selection_is_what_vllm_routed(pair):
    """Oracle: vLLM's own routed-experts callback (``router.set_capture_fn``), which the router
    calls with the expert ids it computed, on every MoE layer."""
    vllm, _ = pair
    tokens = vllm.to_tokens(PROMPT)
    block = "block_sparse_moe" if vllm.info.family == "mixtral" else "mlp"
    layers = vllm.info.moe_layers
    seen: dict[int, list] = {L: [] for L in layers}

    def install(model, on):
        for L in layers:
            router = model.model.layers[L].get_submodule(f"{block}.experts").router
            router.set_capture_fn((lambda ids, L=L: seen[L].append(ids.clone())) if on else None)

    vllm.llm.apply_model(lambda m: install(m, True))
    try:
        cache = run_with_cache(vllm, tokens, [f"expert_indices.{L}" for L in layers])
    finally:
        vllm.llm.apply_model(lambda m: install(m, False))
    for L in layers:
        assert len(seen[L]) == 1, "one prefill forward"
        assert torch.equal(cache.get("expert_indices", L)[0], seen[L][0].long())
    assert engine_state(vllm)[0]["hooks"] == 0, "the router's select_experts is restored after the capture"


def test_expert_assignment_from_vllm_router_logits(pair):
    """With only router_logits (what the seed says vLLM serves), the named rule gives the eager
    assignment back."""
    vllm, eager = pair
    info = vllm.info
    L = info.moe_layers[-1]
    renormalize = getattr(eager.hf.config, "norm_topk_prob", True)
    logits_only = run_with_cache(vllm, vllm.to_tokens(PROMPT), [f"router_logits.{L}"])
    want = run_with_cache(eager, eager.to_tokens(PROMPT), [f"expert_weights.{L}", f"expert_indices.{L}"])
    derived = expert_assignment(logits_only, L, info.n_experts, top_k=info.top_k, renormalize=renormalize)
    assert_near(derived, expert_assignment(want, L, info.n_experts), "derived assignment")


def test_selection_while_generating(pair):
    vllm, eager = pair
    L = vllm.info.moe_layers[0]
    tokens = vllm.to_tokens("Hi")
    completion, cache = capture_generation(vllm, tokens, [f"expert_weights.{L}", f"expert_indices.{L}"],
                                           max_tokens=3, stop_at_eos=False)
    n = tokens.shape[1] + len(completion.token_ids) - 1
    assert cache.get("expert_indices", L).shape == (1, n, vllm.info.top_k)
    want = run_with_cache(eager, cache.tokens, [f"expert_weights.{L}", f"expert_indices.{L}"])
    assert_near(expert_assignment(cache, L, vllm.info.n_experts), expert_assignment(want, L, vllm.info.n_experts),
                "assignment at generated positions")


# -- where the selection cannot be read ------------------------------------------------------------


def _layer(monolithic: bool | None):
    """A stand-in for a vLLM 0.32 decoder layer: ``mlp.experts`` is the MoE runner, with a router."""
    if monolithic is None:
        return types.SimpleNamespace(mlp=types.SimpleNamespace())  # a dense layer
    quant = types.SimpleNamespace(is_monolithic=monolithic)
    runner = types.SimpleNamespace(router=types.SimpleNamespace(select_experts=lambda *a: None),
                                   routed_experts=types.SimpleNamespace(quant_method=quant))
    return types.SimpleNamespace(mlp=types.SimpleNamespace(experts=runner))


def test_monolithic_kernels_leave_the_selection_unserved():
    from interp_engine.archs import vllm_sites

    table = vllm_sites("qwen3_moe")
    assert unreadable_sites([_layer(None), _layer(False)], table) == []
    assert sorted(unreadable_sites([_layer(None), _layer(True)], table)) == ["expert_indices", "expert_weights"]
    assert sorted(unreadable_sites([_layer(None)], table)) == ["expert_indices", "expert_weights"]


def test_unserved_selection_points_to_router_logits_and_expert_assignment(pair):
    vllm, _ = pair
    unserved = vllm.unserved | {"expert_weights", "expert_indices"}
    L = vllm.info.moe_layers[0]
    with pytest.raises(AddressError, match=rf"not served on the vllm backend.*'router_logits\.{L}'.*"
                                           rf"expert_assignment\(cache, {L}, n_experts.*backend='eager'"):
        check_points([f"expert_weights.{L}"], vllm.info, vllm.capabilities.serving(unserved))
    assert {"expert_weights", "expert_indices"}.isdisjoint(vllm.unserved), "served on vLLM-CPU (modular kernels)"
