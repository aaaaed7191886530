"""A vLLM-backed cluster model against the local vLLM model: a padded batch is split per prompt,
each prompt runs at its true length on a replica, and the rows come back padded — the values the
local engine gives prompt by prompt. The replica's engine may batch prompts together that the
local one ran alone (continuous batching), a different computation: equal within the equality
contract's same-backend tolerance, not bit for bit (docs/CLUSTER.md, "Equality")."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import capture_generation, load_model, run_with_cache

from ..oracles import REL_SAME, assert_near

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

POINTS = ["resid_post.1", "z.0", "mlp_out.2", "logits"]
KV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def models(tiny_path):
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    path = str(tiny_path("llama"))
    cluster = load_model(path, backend="vllm", replicas=1, cpus_per_replica=0.5, env_vars=KV, max_model_len=128)
    local = load_model(path, backend="vllm", max_model_len=128)
    yield local, cluster
    cluster.close()
    local.close()
    ray.shutdown()


def test_vllm_cluster_takes_a_padded_batch(models):
    local, cluster = models
    tokens = local.tok.to_tokens(["The quick brown fox", "jumps", "over the lazy dog again"])
    got = run_with_cache(cluster, tokens, POINTS)
    assert torch.equal(got.tokens, tokens) and torch.equal(got.mask, tokens >= 0)
    for row in range(tokens.shape[0]):
        n = int((tokens[row] >= 0).sum())
        want = run_with_cache(local, tokens[row : row + 1, :n], POINTS)
        for address, tensor in want.items():
            assert_near(got[address][row : row + 1, :n], tensor, f"row {row} {address}", REL_SAME)
            assert not got[address][row, n:].any(), "padded positions must be zero"


def test_vllm_cluster_generation_and_async_equal_local(models):
    local, cluster = models
    tokens = local.to_tokens("Once upon a time")
    c1, cache1 = capture_generation(local, tokens, ["resid_post.2"], max_tokens=6)
    c2, cache2 = capture_generation(cluster, tokens, ["resid_post.2"], max_tokens=6)
    assert c1.token_ids == c2.token_ids and c1.text == c2.text
    assert torch.equal(cache1.tokens, cache2.tokens)
    assert_near(cache2["resid_post.2"], cache1["resid_post.2"], "generation", REL_SAME)

    prompts = [local.to_tokens(t) for t in ("a", "bb cc", "ddd eee fff")]

    async def gather(model):
        return await asyncio.gather(*(model.capture(p, ["resid_post.0"]) for p in prompts))

    for want, got in zip(asyncio.run(gather(local)), asyncio.run(gather(cluster))):
        assert list(got) == list(want)
        for address in want:
            assert_near(got[address], want[address], f"async {address}", REL_SAME)


def test_a_replica_error_names_its_replica_and_shard(models):
    """The engine's max_model_len (128) is below the model's 256 positions: the driver's checks pass
    and the replica refuses — the error keeps its type and says where it happened."""
    from interp_engine import InputError

    local, cluster = models
    tokens = local.tok.to_tokens(["short", "x" * 150])
    with pytest.raises(InputError, match=r"^\[replica 0 on node \w{8}, shard 1\] .*max_model_len"):
        run_with_cache(cluster, tokens, ["resid_post.0"])
    assert run_with_cache(cluster, tokens[:1, :6], ["resid_post.0"])["resid_post.0"].shape[1] == 6


def test_vllm_cluster_dataset_equals_local_vllm_dataset(models, tmp_path):
    from interp_engine import build_dataset

    local, cluster = models
    prompts = [f"row {i} " + "abc " * (i % 4) for i in range(7)]
    a = build_dataset(local, prompts, ["resid_post.1"], tmp_path / "local", shard_size=3, progress=False)
    b = build_dataset(cluster, prompts, ["resid_post.1"], tmp_path / "cluster", shard_size=3, progress=False)
    assert a.rows == b.rows == 7 and a.manifest["identity"] == b.manifest["identity"]
    from interp_engine.dataset.shard import read_tensor

    ta, tb = a.to_arrow(), b.to_arrow()
    assert ta.column("prompt_index").equals(tb.column("prompt_index")) and ta.schema.equals(tb.schema)
    assert_near(read_tensor(tb, "resid_post.1"), read_tensor(ta, "resid_post.1"), "dataset", REL_SAME)
