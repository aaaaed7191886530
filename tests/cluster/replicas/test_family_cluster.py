"""GPT-2 on a 2-replica cluster and in a dataset build, and a generic-path model on a replica, on the
folder's shared simulated cluster (conftest.py; these replicas are CPU-only, beside its own): the same tensors as the local eager model (tests/archs/test_family_gpt2.py checks
that one against HF and by hand). What a replica sends back is read the way the family stores it:
GPT-2's output projection transposed (Conv1D), its final LayerNorm rebuilt at ``transformer.ln_f``.
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import head_contributions, load_model, logit_attribution, logit_lens, run_with_cache
from interp_engine.dataset.build import build_dataset

from ... import tiny_gpt
from ...oracles import assert_caches_near, assert_near, torch_threads

ray = pytest.importorskip("ray")

#: the workers' fake GPUs hold the folder's llama replicas; these take half a CPU each, one torch thread
CPU_REPLICA = dict(gpus_per_replica=0, cpus_per_replica=0.5, device="cpu", torch_threads=1)
POINTS = ["resid_pre.0", "attn_out_post", "mlp_out_post", "resid_mid.1", "resid_post", "z.1", "logits"]


@pytest.fixture(scope="module")
def models(cluster, tiny_root):
    """(GPT-2 on 2 replicas, the same GPT-2 loaded locally)."""
    path = str(tiny_gpt.build("gpt2", tiny_root))
    model = load_model(path, replicas=2, **CPU_REPLICA)
    yield model, load_model(path)
    model.close()


def test_a_padded_batch_and_the_analysis_helpers_equal_local(models):
    remote, local = models
    tokens = local.tok.to_tokens(["The quick brown fox", "jumps", "over the lazy dog again"])
    got = run_with_cache(remote, tokens, POINTS)
    with torch_threads(CPU_REPLICA["torch_threads"]):
        want = run_with_cache(local, tokens, POINTS)
    assert_caches_near(got, want)
    assert torch.equal(remote.o_proj_weight(1), local.o_proj_weight(1).detach())
    assert_near(head_contributions(remote, got, 1), head_contributions(local, want, 1), "head_contributions", 1e-5)
    ids = want["logits"].argmax(-1).clamp(min=0)
    assert_near(logit_attribution(remote, got, ids), logit_attribution(local, want, ids), "logit_attribution", 1e-5)
    assert_near(logit_lens(remote, got), logit_lens(local, want), "logit lens", 1e-5)


def test_a_dataset_build_equals_the_local_build(models, tmp_path):
    remote, local = models
    prompts = [f"Sample {i}: " + "alpha beta gamma"[: 5 + 3 * i] for i in range(12)]
    with torch_threads(1):  # the replicas' threads: the same computation shard for shard
        a = build_dataset(local, prompts, ["resid_post.1", "z.0"], tmp_path / "local", shard_size=4, progress=False)
    b = build_dataset(remote, prompts, ["resid_post.1", "z.0"], tmp_path / "cluster", shard_size=4, progress=False)
    assert a.rows == b.rows == 12 and a.to_arrow().equals(b.to_arrow())


def test_a_generic_path_model_on_a_replica(cluster, tiny_root):
    """The replica proves the generic record on its own copy; the driver rebuilds the final norm
    from the weights it sends (no softcapping: the proof was logits == unembed(final_norm(x)))."""
    path = str(tiny_gpt.build("stablelm", tiny_root))
    remote = load_model(path, replicas=1, **CPU_REPLICA)
    try:
        local = load_model(path)
        assert remote.info == local.info and remote.points() == local.points()
        tokens = local.to_tokens("no record")
        got = run_with_cache(remote, tokens, ["resid_post", "mlp_post.1", "logits"])
        with torch_threads(1):
            want = run_with_cache(local, tokens, ["resid_post", "mlp_post.1", "logits"])
        assert_caches_near(got, want)
        assert_near(logit_lens(remote, got), logit_lens(local, want), "logit lens", 1e-5)
    finally:
        remote.close()
