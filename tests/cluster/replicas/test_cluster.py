"""Cluster-backed models on a simulated 3-node Ray cluster (head + 2 workers with one fake GPU
each): same tensors as the local model, replicas on different nodes, faults, bad inputs, and
datasets that read back everywhere."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from interp_engine import AddressError, InputError, capture_generation, load_model, run_with_cache
from interp_engine.errors import ClusterError, DatasetExistsError, PromptsError
from interp_engine.dataset.build import build_dataset

from ... import sampling_checks
from ...clusters import REPLICA
from ...faults import kill_replica
from ...oracles import assert_caches_near, row_chunks, torch_threads

ray = pytest.importorskip("ray")
POINTS = ["resid_post.1", "z.0", "attn_out.2", "logits"]


def test_replicas_land_on_different_nodes(cluster_llama):
    head = ray.get_runtime_context().get_node_id()
    assert len(set(cluster_llama.nodes)) == 2 and head not in cluster_llama.nodes


def test_padded_batch_equals_local(cluster_llama, eager_models):
    """Each replica runs its contiguous chunk of the batch at the batch's width: the same
    computation as the local model on that chunk with the same threads (bit for bit), and the
    same values as the local batch within the equality contract."""
    local = eager_models("llama")
    tokens = local.tok.to_tokens(["The quick brown fox", "jumps", "over the lazy dog again", "!"])
    got = run_with_cache(cluster_llama, tokens, POINTS)
    with torch_threads(REPLICA["torch_threads"]):
        chunks = [run_with_cache(local, chunk, POINTS) for chunk in row_chunks(tokens, cluster_llama.replicas)]
        whole = run_with_cache(local, tokens, POINTS)
    assert list(got) == list(whole)
    assert torch.equal(got.tokens, tokens) and torch.equal(got.mask, tokens >= 0)
    for address in whole:
        assert torch.equal(got[address], torch.cat([c[address] for c in chunks])), address
    assert_caches_near(got, whole)
    assert got.model_name == whole.model_name and got.backend == whole.backend == "eager"


def test_head_contributions_work_on_a_cluster_model(cluster_llama, eager_models):
    from interp_engine import head_contributions

    local = eager_models("llama")
    tokens = local.to_tokens("heads")
    got = head_contributions(cluster_llama, run_with_cache(cluster_llama, tokens, ["z.1"]), 1)
    with torch_threads(REPLICA["torch_threads"]):
        want = head_contributions(local, run_with_cache(local, tokens, ["z.1"]), 1)
    assert torch.equal(got, want)
    assert torch.equal(cluster_llama.o_proj_weight(1), local.o_proj_weight(1).detach())


def test_capture_generation_equals_local(cluster_llama, eager_models):
    local = eager_models("llama")
    tokens = local.to_tokens("Hello there")
    c2, cache2 = capture_generation(cluster_llama, tokens, ["resid_post.2", "logits"], max_tokens=5)
    with torch_threads(REPLICA["torch_threads"]):
        c1, cache1 = capture_generation(local, tokens, ["resid_post.2", "logits"], max_tokens=5)
    assert c1 == c2
    assert torch.equal(cache1.tokens, cache2.tokens)
    for address in cache1:
        assert torch.equal(cache1[address], cache2[address])



@pytest.mark.parametrize("check", sampling_checks.PROPERTIES, ids=lambda check: check.__name__)
def test_sampling(cluster_llama, check):
    """What temperature, top-k, top-p and seed mean, as on a local model: the options and the
    seed reach the replica (tests/sampling_checks.py)."""
    check(cluster_llama)

def test_async_capture_equals_local(cluster_llama, eager_models):
    local = eager_models("llama")
    prompts = [local.to_tokens(t) for t in ("one", "two words", "three words here", "four")]

    async def gather(model):
        return await asyncio.gather(*(model.capture(p, ["resid_post.0", "mlp_out.1"]) for p in prompts))

    got_all = asyncio.run(gather(cluster_llama))
    with torch_threads(REPLICA["torch_threads"]):
        want_all = asyncio.run(gather(local))
    for want, got in zip(want_all, got_all):
        assert type(got) is dict and list(got) == list(want)
        assert all(torch.equal(got[a], want[a]) for a in want)
        with pytest.raises(KeyError):
            got["resid_post.0"]


def test_cluster_equals_local_within_tolerance_whatever_the_threads(cluster_llama, eager_models):
    """With the local model on another thread count the computation differs, so the contract is
    the relative tolerance, not bitwise equality (docs/CLUSTER.md, "Equality")."""
    local = eager_models("llama")
    tokens = local.tok.to_tokens(["a longer prompt with several words", "short"])
    got = run_with_cache(cluster_llama, tokens, POINTS)
    with torch_threads(2):
        want = run_with_cache(local, tokens, POINTS)
    assert_caches_near(got, want)


def test_bad_inputs_fail_before_any_work(cluster, cluster_llama, tiny_path, tmp_path):
    with pytest.raises(InputError, match="replicas must be a positive int"):
        load_model(str(tiny_path("llama")), replicas=0)
    with pytest.raises(ClusterError, match="needs 2 GPUs on one node"):
        load_model(str(tiny_path("llama")), replicas=1, gpus_per_replica=2, device="cpu")
    with pytest.raises(ClusterError, match="needs 2 GPUs on one node"):  # before any vLLM engine starts
        load_model(str(tiny_path("llama")), backend="vllm", replicas=1, tensor_parallel_size=2)
    with pytest.raises(ClusterError, match="at most 2 fit"):
        load_model(str(tiny_path("llama")), replicas=3, **REPLICA)
    with pytest.raises(AddressError, match="unknown site"):
        run_with_cache(cluster_llama, cluster_llama.to_tokens("hi"), ["resid_psot.1"])
    with pytest.raises(AddressError, match="layer 9 is out of range"):
        build_dataset(cluster_llama, ["hi"], ["resid_post.9"], tmp_path / "a", progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PromptsError, match="holds no prompts"):
        build_dataset(cluster_llama, empty, ["resid_post.1"], tmp_path / "b", progress=False)
    with pytest.raises(PromptsError, match="does not exist"):
        build_dataset(cluster_llama, tmp_path / "missing.jsonl", ["resid_post.1"], tmp_path / "c", progress=False)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def _prompts(n):
    return [f"Sample {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) * (1 + i % 3)
            for i in range(n)]


def test_cluster_dataset_equals_local_dataset(cluster_llama, eager_models, tmp_path):
    local = eager_models("llama")
    prompts = _prompts(30)
    for layout in ("sequence", "token"):
        with torch_threads(REPLICA["torch_threads"]):  # the same computation as a replica's shard
            a = build_dataset(local, prompts, ["resid_post.1", "z.0"], tmp_path / f"local-{layout}", layout=layout,
                              shard_size=4, progress=False)
        b = build_dataset(cluster_llama, prompts, ["resid_post.1", "z.0"], tmp_path / f"cluster-{layout}",
                          layout=layout, shard_size=4, progress=False)
        assert a.rows == b.rows == (30 if layout == "sequence" else a.tokens)
        assert a.to_arrow().equals(b.to_arrow())
        assert [f.name for f in a.files] == [f.name for f in b.files]


def test_killing_a_replica_mid_build_changes_nothing(cluster, tiny_path, eager_models, tmp_path):
    local = eager_models("llama")
    prompts = _prompts(48)
    with torch_threads(1):  # the replicas' threads: the same computation shard for shard
        clean = build_dataset(local, prompts, ["resid_post.2"], tmp_path / "clean", shard_size=2, progress=False)
    # CPU-only replicas: the fake GPUs are held by the module's model
    model = load_model(str(tiny_path("llama")), replicas=2, gpus_per_replica=0, cpus_per_replica=0.25,
                       torch_threads=1)
    out = tmp_path / "faulty"

    def killer():
        while len(list(out.glob("part-*.parquet"))) < 3:
            time.sleep(0.01)
        kill_replica(model, 1, restart=False)  # gone for good: the other replica finishes alone

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        faulty = build_dataset(model, prompts, ["resid_post.2"], out, shard_size=2, progress=False)
    finally:
        thread.join(timeout=30)
    assert ray.get(model._coordinator.resubmitted.remote()) >= 1  # the kill hit work in flight
    assert faulty.rows == 48
    table = faulty.to_arrow()
    assert sorted(table.column("prompt_index").to_pylist()) == list(range(48))  # no duplicates, none lost
    assert table.equals(clean.to_arrow())
    # the surviving replica keeps serving
    tokens = local.to_tokens("still alive")
    with torch_threads(1):
        want = run_with_cache(local, tokens, ["resid_post.0"])["resid_post.0"]
    assert torch.equal(run_with_cache(model, tokens, ["resid_post.0"])["resid_post.0"], want)
    model.close()


def test_dataset_reads_back_with_pyarrow_pandas_and_ray_data(cluster_llama, tmp_path):
    import numpy as np
    import pandas as pd
    import pyarrow.parquet as pq

    from interp_engine.dataset.shard import column_shape, read_tensor

    prompts = _prompts(10)
    ds = build_dataset(cluster_llama, prompts, ["resid_post.1", "z.0"], tmp_path / "d", shard_size=3,
                       progress=False, dtype="bfloat16")
    n, width = 10, ds.manifest["identity"]["max_length"]
    table = pq.read_table(tmp_path / "d")
    assert table.num_rows == n and column_shape(table.schema, "z.0") == (width, 4, 64)
    z = read_tensor(table, "z.0")
    assert z.dtype == torch.bfloat16 and z.shape == (n, width, 4, 64)
    frame = pd.read_parquet(tmp_path / "d")  # nested arrays, bf16 as its exact float32 values
    assert np.stack(frame["resid_post.1"].iloc[0]).shape == (width, 128)
    rows = ds.to_ray().take_all()
    assert len(rows) == n and rows[0]["z.0"].shape == (width, 4, 64)
    # bf16 is stored bit for bit: the same capture rounded once
    cache = run_with_cache(cluster_llama, cluster_llama.to_tokens(prompts[0]), ["z.0"])
    length = cache.tokens.shape[1]
    ordered = torch.argsort(torch.tensor(table.column("prompt_index").to_pylist()))
    assert torch.equal(z[ordered][0, :length].view(torch.int16),
                       cache["z.0"][0].to(torch.bfloat16).view(torch.int16))


def test_output_with_a_different_dataset_is_refused(cluster_llama, tmp_path):
    build_dataset(cluster_llama, _prompts(4), ["resid_post.1"], tmp_path / "o", progress=False)
    with pytest.raises(DatasetExistsError, match="holds a different dataset.*overwrite=True"):
        build_dataset(cluster_llama, _prompts(5), ["resid_post.1"], tmp_path / "o", progress=False)
    again = build_dataset(cluster_llama, _prompts(5), ["resid_post.1"], tmp_path / "o", progress=False,
                          overwrite=True)
    assert again.rows == 5


def test_prompts_from_a_ray_dataset(cluster_llama, tmp_path):
    prompts = _prompts(9)
    from_list = build_dataset(cluster_llama, prompts, ["resid_post.0"], tmp_path / "l", shard_size=4, progress=False)
    ray_ds = ray.data.from_items([{"text": p, "id": i} for i, p in enumerate(prompts)])
    from_ray = build_dataset(cluster_llama, ray_ds, ["resid_post.0"], tmp_path / "r", shard_size=4, progress=False)
    assert from_ray.manifest["identity"] == from_list.manifest["identity"]
    assert from_ray.to_arrow().equals(from_list.to_arrow())


def test_a_crashed_replica_is_restarted_and_the_build_ends_on_both(cluster, tmp_path):
    """Kill one of two replicas early in a 300-prompt build: Ray restarts it, it rejoins, and the
    second half of the shards is written by both replicas again. SmolLM2, so that the build
    outlasts a replica's restart (a new process importing torch and loading the model)."""
    from interp_engine.embedded import NAME
    from interp_engine.tokens import pad_batch

    prompts = [f"Note {i}: " + "the cat sat on the mat and looked at the dog. " * 4 for i in range(300)]
    model = load_model(NAME, replicas=2, gpus_per_replica=0, cpus_per_replica=0.25, torch_threads=1)
    out = tmp_path / "healed"
    before = ray.get(model._replicas[1].ping.remote())

    def killer():
        while len(list(out.glob("part-*.parquet"))) < 3:
            time.sleep(0.01)
        kill_replica(model, 1)  # a crash: Ray restarts the process (max_restarts=3)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        healed = build_dataset(model, prompts, ["resid_post.10"], out, shard_size=5, progress=False)
        thread.join(timeout=30)
        assert ray.get(model._coordinator.rejoined.remote()) >= 1
    finally:
        model.close()
    writers = {int(name[5:10]): rec for name, rec in healed.manifest["shards"].items()}
    assert len(writers) == 60 and healed.rows == 300
    second_half = [writers[i] for i in range(30, 60)]
    assert {w["replica"] for w in second_half} == {0, 1}, "both replicas write the second half"
    assert before not in {w["pid"] for w in second_half}, "replica 1 runs in a new process"
    # shards of both replicas, before and after the restart, equal the same batch run here with 1 thread
    local = load_model(NAME)
    table = healed.to_arrow()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        restarted = next(i for i in range(30, 60) if writers[i]["replica"] == 1)
        for shard in sorted({0, 1, 2, restarted, next(i for i in range(30, 60) if writers[i]["replica"] == 0)}):
            batch = pad_batch([local.tok.encode(p) for p in prompts[shard * 5: shard * 5 + 5]])
            want = run_with_cache(local, batch, ["resid_post.10"])["resid_post.10"]
            rows = [r for r, p in enumerate(table.column("prompt_index").to_pylist()) if shard * 5 <= p < shard * 5 + 5]
            from interp_engine.dataset.shard import read_tensor

            got = read_tensor(table.take(rows), "resid_post.10")[:, : batch.shape[1]]
            assert torch.equal(got, want), f"shard {shard} (replica {writers[shard]['replica']})"
    finally:
        torch.set_num_threads(threads)
