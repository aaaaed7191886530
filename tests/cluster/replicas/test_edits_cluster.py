"""Edits through cluster models (a simulated 3-node Ray cluster: eager replicas, and a vLLM
replica): the edits travel as data and each replica resolves their positions against its own
rows. The oracle is the same edit on a local model, within the equality contract (a replica
runs a different batch shape and thread count: tests/oracles.py)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import (Ablate, Add, AddressError, Cap, InputError, Rotate, Scale, Set, Swap, Zero, capture_generation,
                           run_with_cache)

from ...contract import assert_contract
from ...oracles import REL, assert_near

ray = pytest.importorskip("ray")
PROMPTS = ["The quick brown fox", "jumps", "over the lazy dog again", "!!"]


def test_an_eager_cluster_implements_the_contract(cluster_llama):
    assert_contract(cluster_llama, writes_shards=True)


def _edits(model):
    g = torch.Generator().manual_seed(5)
    return {
        "resid_post.1": Add(torch.randn(model.d_model, generator=g), scale=4.0, positions=[0, -1]),
        "z.0": Zero(heads=[2]),
        "mlp_post.2": Scale(0.5, positions=slice(1, None)),
        "attn_out.0": Set(torch.randn(model.d_model, generator=g), positions=-2),
        "mlp_out.1": [Ablate(torch.randn(model.d_model, generator=g)),  # directional edits, in order
                      Rotate(torch.randn(model.d_model, generator=g), angle=0.8),
                      Cap(torch.randn(model.d_model, generator=g), max=1e-3, min=-1e-3, positions=[0, -1]),
                      Swap(torch.randn(model.d_model, generator=g), projection=0.5, positions=[0])],
    }


def test_edits_on_an_eager_cluster_equal_local(cluster_llama, eager_models):
    local = eager_models("llama")
    tokens = local.tok.to_tokens(PROMPTS)
    for name, edit in _edits(local).items():
        if name == "attn_out.0":  # position -2 of a one-token prompt does not exist
            continue
        edits = {name: edit}
        got = run_with_cache(cluster_llama, tokens, ["logits", "resid_post.2"], edits=edits)
        want = run_with_cache(local, tokens, ["logits", "resid_post.2"], edits=edits)
        plain = run_with_cache(local, tokens, ["logits"])
        assert (want["logits"] - plain["logits"]).abs().max() > 1e-3
        for point in ("logits", "resid_post.2"):
            assert_near(got[point], want[point], f"{name} {point}", 1e-5)
    prompt = local.to_tokens("Hello there")
    edits = _edits(local)
    want, want_cache = capture_generation(local, prompt, ["logits"], max_tokens=5, edits=edits)
    got, got_cache = capture_generation(cluster_llama, prompt, ["logits"], max_tokens=5, edits=edits)
    assert got.token_ids == want.token_ids
    assert_near(got_cache["logits"], want_cache["logits"], "cluster generation with edits", 1e-5)


def test_cluster_refuses_code_and_splits_whole_batch_values(cluster_llama, eager_models):
    local = eager_models("llama")
    tokens = local.tok.to_tokens(PROMPTS)
    with pytest.raises(InputError, match="cannot be sent to cluster replicas"):
        run_with_cache(cluster_llama, tokens, ["logits"], edits={"resid_post.1": lambda t, a: t})
    whole = torch.randn(tokens.shape[0], tokens.shape[1], local.d_model, generator=torch.Generator().manual_seed(1))
    got = run_with_cache(cluster_llama, tokens, ["logits"], edits={"resid_pre.0": Set(whole)})  # split with the rows
    want = run_with_cache(local, tokens, ["logits"], edits={"resid_pre.0": Set(whole)})
    assert_near(got["logits"], want["logits"], "a whole-batch Set over replicas", 1e-5)
    with pytest.raises(InputError, match="out of range"):
        run_with_cache(cluster_llama, tokens, ["logits"], edits={"resid_pre.0": Zero(positions=[6])})
    got = run_with_cache(cluster_llama, tokens, ["logits"])
    assert_near(got["logits"], run_with_cache(local, tokens, ["logits"])["logits"], "still serving", 1e-5)


def test_a_vllm_cluster_implements_the_contract(cluster_vllm):
    assert_contract(cluster_vllm, writes_shards=True)


def test_edits_on_a_vllm_replica_equal_local_eager(cluster_vllm, eager_models):
    local = eager_models("llama")
    tokens = local.tok.to_tokens(PROMPTS)
    edits = {k: v for k, v in _edits(local).items() if k != "attn_out.0"}
    got = run_with_cache(cluster_vllm, tokens, ["logits", "resid_post.2"], edits=edits)
    want = run_with_cache(local, tokens, ["logits", "resid_post.2"], edits=edits)
    for point in ("logits", "resid_post.2"):
        assert_near(got[point], want[point], f"vLLM replica {point}", REL)
    prompt = local.to_tokens("Hello there")
    want_c, want_cache = capture_generation(local, prompt, ["logits"], max_tokens=5, edits=_edits(local))
    got_c, got_cache = capture_generation(cluster_vllm, prompt, ["logits"], max_tokens=5, edits=_edits(local))
    assert got_c.token_ids == want_c.token_ids
    assert_near(got_cache["logits"], want_cache["logits"], "vLLM replica generation", REL)
    with pytest.raises(AddressError, match="cannot be edited on the vllm backend"):
        run_with_cache(cluster_vllm, tokens[:1], ["logits"], edits={"pattern.1": Zero()})
