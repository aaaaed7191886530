"""activation_stream on a cluster model: every replica captures chunks at once, and an epoch still
yields exactly a dataset build's rows, in the order its seed fixes, even when a replica dies."""

from __future__ import annotations

import numpy as np
import pytest

from interp_engine import activation_stream, load_model

from ...faults import kill_replica
from ...oracles import torch_threads
from ...stream.rows import as_rows, built_rows, joined, same_multiset

ray = pytest.importorskip("ray")
POINTS = ["resid_post.1", "mlp_out.0"]
PROMPTS = [f"Sample {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) * (1 + i % 3)
           for i in range(40)]
SETTINGS = dict(batch_tokens=64, shuffle_buffer=192, shard_size=2, seed=3, progress=False)


@pytest.fixture(scope="module")
def built(eager_models, tmp_path_factory):
    with torch_threads(1):  # the replicas' threads: the same computation row for row
        rows = built_rows(eager_models("llama"), PROMPTS, POINTS, tmp_path_factory.mktemp("ds") / "d", shard_size=2)
    return as_rows(rows, POINTS)


def test_cluster_stream_is_the_dataset_and_resumes(cluster_llama, built):
    stream = activation_stream(cluster_llama, PROMPTS, POINTS, **SETTINGS)
    assert stream.prefetch == 4  # two chunks per replica in flight
    batches = list(stream)
    rows = joined(batches, POINTS)
    assert same_multiset(rows, built)
    before = []
    for batch in stream:
        before.append(batch)
        if len(before) == 3:
            break
    after = list(activation_stream(cluster_llama, PROMPTS, POINTS, resume=stream.state(), **SETTINGS))
    assert np.array_equal(joined(before + after, POINTS), rows)  # whatever replica answered first


def test_killing_a_replica_mid_stream_changes_nothing(cluster, tiny_path, built):
    # CPU-only replicas: the fake GPUs are held by the package's model
    model = load_model(str(tiny_path("llama")), replicas=2, gpus_per_replica=0, cpus_per_replica=0.25,
                       torch_threads=1)
    try:
        batches = []
        for batch in activation_stream(model, PROMPTS, POINTS, prefetch=8, **SETTINGS):
            batches.append(batch)
            if len(batches) == 1:
                kill_replica(model, 1, restart=False)  # gone for good: the other replica finishes alone
        assert same_multiset(joined(batches, POINTS), built)  # nothing lost, nothing twice
        resubmitted = ray.get(model._coordinator.resubmitted.remote())
        assert resubmitted >= 1  # the kill hit captures in flight
    finally:
        model.close()
