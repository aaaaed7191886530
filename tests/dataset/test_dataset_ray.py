"""The notebook flow on a machine whose CPUs are all held by replicas: ``ray.init()`` with 2 CPUs,
``load_model(..., replicas=2)``, ``build_dataset``, ``ds.to_ray().take(1)`` completes; a read
that asks for CPUs nobody has free fails fast, saying why and what to do."""

from __future__ import annotations

import time

import numpy as np
import pytest

from interp_engine import ActivationDataset, ClusterError, build_dataset, load_model
from interp_engine.dataset.shard import read_tensor

ray = pytest.importorskip("ray")
PROMPTS = [f"Note {i}: " + "alpha beta " * (1 + i % 4) for i in range(12)]


@pytest.fixture(scope="module")
def busy(tiny_path):
    """2 CPUs, both held by the replicas (cpus_per_replica defaults to 1)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    model = load_model(str(tiny_path("llama")), replicas=2, torch_threads=1)
    assert ray.available_resources().get("CPU", 0) == 0
    yield model
    model.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def dataset(busy, tmp_path_factory):
    return build_dataset(busy, PROMPTS, ["resid_post.1"], tmp_path_factory.mktemp("ray") / "d", layout="token",
                         shard_size=3, progress=False)


def test_to_ray_reads_while_replicas_hold_every_cpu(busy, dataset):
    start = time.monotonic()
    first = dataset.to_ray().take(1)
    assert len(first) == 1 and time.monotonic() - start < 120
    rows = dataset.to_ray().take_all()
    table = dataset.to_arrow()
    assert len(rows) == dataset.rows == table.num_rows
    by_key = {(r["prompt_index"], r["position"]): r for r in rows}
    want = read_tensor(table, "resid_post.1").numpy()
    for i, (p, pos) in enumerate(zip(table.column("prompt_index").to_pylist(), table.column("position").to_pylist())):
        assert np.array_equal(np.asarray(by_key[(p, pos)]["resid_post.1"]).reshape(want[i].shape), want[i])


def test_replicas_record_checksums_the_driver_can_verify(dataset):
    dataset.verify()
    assert ActivationDataset.open(dataset.path, verify=True).rows == dataset.rows


def test_a_read_that_cannot_be_scheduled_fails_fast(busy, dataset):
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"cannot be scheduled.*to_ray\(num_cpus=0\).*model.close\(\)"):
        dataset.to_ray(num_cpus=1, wait_s=1)
    assert time.monotonic() - start < 10
