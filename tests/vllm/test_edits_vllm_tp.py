"""Edits under tensor parallelism (two vLLM worker processes on this CPU) == the same edits at
TP=1 and on eager. The tiny Llama has four query heads (two per rank) and one kv head
(replicated on both ranks), so a head edit that spans ranks, a vector cut per rank, and an edit
of a replicated kv head are all exercised."""

from __future__ import annotations

import pytest
import torch

from interp_engine import (Ablate, Add, Cap, InputError, Rotate, Scale, Set, Swap, Zero, capture_generation, load_model,
                           run_with_cache)

from .. import tiny
from ..oracles import REL, assert_near
from ..probes import engine_state

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(tiny.build_one_kv_head(tmp_path_factory.mktemp("tp_edit_tiny")))


@pytest.fixture(scope="module")
def tp2(path):
    with load_model(path, backend="vllm", max_model_len=128, tensor_parallel_size=2) as model:
        yield model


@pytest.fixture(scope="module")
def tp1(path):
    with load_model(path, backend="vllm", max_model_len=128) as model:
        yield model


def _cases(d_head: int, d_mlp: int, d_model: int):
    g = torch.Generator().manual_seed(11)
    return [
        {"z.1": Zero(heads=[1, 2])},                                        # one head on each rank
        {"z.0": Add(torch.randn(2, d_head, generator=g), scale=3.0, heads=[0, 3])},
        {"z.2": Set(torch.randn(4, d_head, generator=g), positions=[1])},     # a block cut per rank
        {"q.1": Zero(heads=[3])},
        {"k.0": Scale(2.0, heads=[0]), "v.1": Add(torch.randn(d_head, generator=g), positions=-1)},
        {"mlp_post.1": Add(torch.randn(d_mlp, generator=g), scale=2.0)},      # columns cut per rank
        {"resid_post.0": Add(torch.randn(d_model, generator=g), scale=4.0), "resid_mid.2": Scale(0.5)},
        # directional edits: a direction per head cut per rank, on chosen heads; a replicated kv head
        {"z.0": Rotate(torch.randn(2, d_head, generator=g), angle=0.7, heads=[0, 3]),
         "z.2": Ablate(torch.randn(4, d_head, generator=g)),
         "k.1": Cap(torch.randn(d_head, generator=g), max=1e-3, min=-1e-3),
         "resid_mid.1": Swap(torch.randn(d_model, generator=g), projection=2.0, positions=[1])},
    ]


def test_tp2_edits_equal_tp1_and_eager(tp2, tp1, path):
    eager = load_model(path, backend="eager")
    tokens = tp1.to_tokens("tensor parallel edits")
    points = ["logits", "resid_post.2", "z.2"]
    plain = run_with_cache(tp1, tokens, ["logits"])["logits"]
    for edits in _cases(tp1.d_head, tp1.d_mlp, tp1.d_model):
        one = run_with_cache(tp1, tokens, points, edits=edits)
        two = run_with_cache(tp2, tokens, points, edits=edits)
        want = run_with_cache(eager, tokens, points, edits=edits)
        assert (one["logits"] - plain).abs().max() > 1e-4, f"{list(edits)} changed nothing"
        for point in points:
            assert_near(two[point], one[point], f"TP=2 {list(edits)} {point}", REL)
            assert_near(two[point], want[point], f"TP=2 vs eager {list(edits)} {point}", REL)


def test_tp2_steered_generation_equals_tp1(tp2, tp1):
    tokens = tp1.to_tokens("steer across ranks")
    vector = torch.randn(tp1.d_model, generator=torch.Generator().manual_seed(2))
    edits = {"resid_post.1": Add(vector, scale=20.0), "z.2": Zero(heads=[1, 2])}
    plain, _ = capture_generation(tp1, tokens, ["logits"], max_tokens=6)
    one, one_cache = capture_generation(tp1, tokens, ["logits"], max_tokens=6, edits=edits)
    two, two_cache = capture_generation(tp2, tokens, ["logits"], max_tokens=6, edits=edits)
    assert one.token_ids != plain.token_ids
    assert two.token_ids == one.token_ids
    assert_near(two_cache["logits"], one_cache["logits"], "TP=2 steered generation", REL)
    for rank in engine_state(tp2):
        assert rank["pending"] == [] and rank["hooks"] == 0 and rank["edited"] == []


def test_tp2_refuses_a_directional_edit_of_split_columns(tp2):
    """mlp_post's columns are split over ranks, so no rank can form a projection on a direction
    of all of them: refused up front with the fix, and the engine keeps serving."""
    tokens = tp2.to_tokens("split columns")
    with pytest.raises(InputError, match="tensor parallelism splits over ranks"):
        run_with_cache(tp2, tokens, ["logits"], edits={"mlp_post.1": Ablate(torch.ones(tp2.d_mlp))})
    assert run_with_cache(tp2, tokens, ["logits"])["logits"].isfinite().all()
