"""MoE routing on the vLLM backend under tensor parallelism (two worker processes on this CPU).

The gate and the router are replicated on every rank (each rank routes every token and holds a
slice of every expert), so ``router_logits`` and the selection are kept from rank 0. Oracle: the
eager backend on the same weights.
"""

from __future__ import annotations

import pytest

from interp_engine import expert_assignment, load_model, run_with_cache

from .. import tiny_moe
from ..oracles import REL
from ..probes import engine_state

pytest.importorskip("vllm")



@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = str(tiny_moe.build("qwen3_moe", tmp_path_factory.mktemp("tp_tiny_moe")))
    with load_model(path, backend="vllm", max_model_len=128, tensor_parallel_size=2) as model:
        yield model, load_model(path, backend="eager")


def test_routing_under_tensor_parallelism_matches_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens("Hello there, experts")
    layers = (1, 10)
    points = [f"{n}.{L}" for L in layers for n in ("router_logits", "expert_weights", "expert_indices", "mlp_out")]
    got, want = run_with_cache(vllm, tokens, points), run_with_cache(eager, tokens, points)
    for L in layers:
        for name in ("router_logits", "mlp_out"):
            err = float((got.get(name, L) - want.get(name, L)).abs().max())
            assert err <= REL * float(want.get(name, L).abs().max()), f"{name}.{L}"
        dense, oracle = expert_assignment(got, L, 128), expert_assignment(want, L, 128)
        assert float((dense - oracle).abs().max()) <= REL * float(oracle.abs().max()), f"assignment at {L}"
    assert [rank["hooks"] for rank in engine_state(vllm)] == [0, 0], "every rank's router is restored"
