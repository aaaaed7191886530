"""Issue 26 through cluster models (one simulated Ray cluster: two eager replicas, and a vLLM
replica): TransformerLens names and negative layers reach the replicas as real addresses, lists
of edits and batched patching values travel as data (a batch's per-row values split with its
rows), and the TL-style attributes answer on the driver. The oracle is the same call on a local
eager model, within the equality contract (a replica runs a different batch shape)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import Add, Address, Scale, Set, Zero, capture_generation, run_with_cache

from ...oracles import REL, assert_near

ray = pytest.importorskip("ray")
PROMPTS = ["The quick brown fox", "jumps", "over the lazy dog again"]


@pytest.fixture(scope="module")
def local(eager_models):
    return eager_models("llama")


def _lists(local):
    vector = torch.randn(local.d_model, generator=torch.Generator().manual_seed(9))
    return {"blocks.-2.hook_resid_post": [Add(vector, scale=3.0), Zero(positions=[0]), Scale(0.5, positions=[-1])],
            "z.0": [Scale(2.0, heads=[0, 1]), Zero(heads=[1])]}


@pytest.mark.parametrize("which", ["eager", "vllm"])
def test_tl_names_negative_layers_and_lists_on_a_cluster(which, cluster_llama, request, local):
    model = cluster_llama if which == "eager" else request.getfixturevalue("cluster_vllm")
    n = local.n_layers
    tokens = local.tok.to_tokens(PROMPTS)
    points = ["blocks.-1.hook_resid_post", ("z", -1), "logits"]
    got = run_with_cache(model, tokens, points, edits=_lists(local))
    want = run_with_cache(local, tokens, points, edits=_lists(local))
    plain = run_with_cache(local, tokens, ["logits"])
    assert list(got) == [Address("resid_post", n - 1), Address("z", n - 1), Address("logits")]
    assert (want["logits"] - plain["logits"]).abs().max() > 1e-3
    for address in want:
        assert_near(got[address], want[address], f"{which} cluster {address}", REL)
    assert got["resid_post", -1] is got[Address("resid_post", n - 1)]
    prompt = local.to_tokens("Hello there")
    steer = {"resid_post.-3": [Add(torch.ones(local.d_model), scale=2.0), Scale(0.5, positions="generated")]}
    want_c, _ = capture_generation(local, prompt, ["logits"], max_tokens=4, edits=steer)
    got_c, got_cache = capture_generation(model, prompt, ["logits"], max_tokens=4, edits=steer)
    assert got_c.token_ids == want_c.token_ids and got_cache.n_layers == n


@pytest.mark.parametrize("which", ["eager", "vllm"])
def test_final_norm_cfg_and_repr_on_a_cluster(which, cluster_llama, request, local):
    model = cluster_llama if which == "eager" else request.getfixturevalue("cluster_vllm")
    tokens = local.tok.to_tokens(PROMPTS)
    got = run_with_cache(model, tokens, ["ln_final.hook_out", "logits"])
    want = run_with_cache(local, tokens, ["final_norm", "logits"])
    for address in want:
        assert_near(got[address], want[address], f"{which} cluster {address}", REL)
    fields = lambda cfg: {k: v for k, v in cfg.to_dict().items() if k != "device"}  # noqa: E731
    assert fields(model.cfg) == fields(local.cfg) and model.tokenizer("a b")["input_ids"] == local.tokenizer("a b")["input_ids"]
    name = local.name.rstrip("/").rsplit("/", 1)[-1]
    replicas = 2 if which == "eager" else 1
    assert repr(model) == f"ClusterModel({name!r}, {local.n_layers} layers, float32, backend={which!r}, replicas={replicas})"


@pytest.mark.parametrize("which", ["eager", "vllm"])
def test_batched_patching_splits_with_the_rows(which, cluster_llama, request, local):
    """Per-row values on a padded batch: the coordinator cuts them with the rows it sends (two
    chunks over eager replicas; one unpadded row per request on the vLLM replica)."""
    model = cluster_llama if which == "eager" else request.getfixturevalue("cluster_vllm")
    tokens = local.tok.to_tokens(PROMPTS)
    g = torch.Generator().manual_seed(22)
    b, w = tokens.shape
    cases = [
        {"resid_post.1": Set(torch.randn(b, local.d_model, generator=g), positions=[0])},
        {"resid_pre.1": Set(torch.randn(b, 1, local.d_model, generator=g), positions=[-1]),
         "z.0": [Scale(2.0), Add(torch.randn(b, local.n_heads, local.d_head, generator=g))]},
        {"mlp_out.0": Add(torch.randn(b, w, local.d_model, generator=g))},
    ]
    plain = run_with_cache(local, tokens, ["logits"])["logits"]
    for edits in cases:
        want = run_with_cache(local, tokens, ["logits", "resid_post.2"], edits=edits)
        got = run_with_cache(model, tokens, ["logits", "resid_post.2"], edits=edits)
        assert (want["logits"] - plain).abs().max() > 1e-3
        for point in ("logits", "resid_post.2"):
            assert_near(got[point], want[point], f"{which} cluster {list(edits)} {point}", REL)


def test_lens_layers_and_short_errors_on_a_cluster(cluster_llama, local):
    from interp_engine import InputError, logit_lens

    tokens = local.tok.to_tokens(PROMPTS)
    got = run_with_cache(cluster_llama, tokens, ["resid_post"])
    want = run_with_cache(local, tokens, ["resid_post"])
    assert_near(logit_lens(cluster_llama, got, -1), logit_lens(local, want, [local.n_layers - 1]), "lens -1", REL)
    big = torch.arange(local.d_model * 4.0) + 1000
    with pytest.raises(InputError) as info:
        run_with_cache(cluster_llama, tokens, ["logits"], edits={"resid_post.1": Scale(big)})
    assert "Tensor[512] float32" in str(info.value) and len(str(info.value)) < 600
