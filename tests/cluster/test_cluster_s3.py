"""Cluster builds straight into object storage: replicas on two simulated nodes write their shards
to a real S3-protocol server (tests/s3server.py); a replica killed mid-build and a driver killed
mid-build (then rerun) both end with the objects of a local-path build, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from interp_engine import ActivationDataset, build_dataset, load_model

from .. import s3server
from ..clusters import simulated_cluster
from ..faults import kill_replica

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
POINTS = ["resid_post.2", "logits"]
REPLICA = dict(gpus_per_replica=0, cpus_per_replica=0.5, torch_threads=1)


def _prompts(n):
    return [f"Shard text {i}: " + "object store " * (1 + i % 5) for i in range(n)]


@pytest.fixture(scope="module")
def s3():
    with s3server.serving("cluster") as server:  # before the cluster starts: its processes inherit it
        yield server


@pytest.fixture(scope="module")
def cluster(s3):
    with simulated_cluster(worker_gpus=0) as c:
        yield c


def _objects(s3, prefix):
    fs = s3.filesystem()
    return {path.rsplit("/", 1)[1]: fs.open_input_stream(path).read() for path in s3.keys("cluster", prefix)}


def _shards(s3, prefix):
    return [k for k in s3.keys("cluster", prefix) if k.rsplit("/", 1)[1].startswith("part-")]


def test_replica_killed_mid_build_into_s3(s3, cluster, tiny_path, eager_models, tmp_path):
    prompts = _prompts(40)
    local = build_dataset(eager_models("llama"), prompts, POINTS, tmp_path / "local", layout="token", shard_size=2,
                          progress=False)
    model = load_model(str(tiny_path("llama")), replicas=2, **REPLICA)
    try:
        assert len(set(model.nodes)) == 2

        def killer():
            deadline = time.monotonic() + 120
            while len(_shards(s3, "killed")) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            kill_replica(model, 1)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        remote = build_dataset(model, prompts, POINTS, "s3://cluster/killed", layout="token", shard_size=2,
                               progress=False)
        thread.join(timeout=30)
        assert ray.get(model._coordinator.resubmitted.remote()) >= 1  # the kill hit work in flight
    finally:
        model.close()
    objects = _objects(s3, "killed")
    assert sorted(objects) == sorted([f.name for f in local.files] + ["_manifest.json"])
    assert all(objects[f.name] == f.read_bytes() for f in local.files)
    assert remote.rows == local.rows
    ActivationDataset.open("s3://cluster/killed", verify=True)


def test_driver_killed_mid_build_into_s3_resumes(s3, cluster, tiny_path, eager_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in _prompts(24)))
    config = tmp_path / "build.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tiny_path("llama")), "replicas": 2, **REPLICA, "prompts": str(prompts), "points": POINTS,
        "output": "s3://cluster/resumed", "layout": "token", "shard_size": 1, "progress": False}))
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    command = [sys.executable, "jobs/build_dataset.py", str(config)]
    driver = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while len(_shards(s3, "resumed")) < 3 and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    partial = len(_shards(s3, "resumed"))
    assert 3 <= partial < 24, f"the kill should land mid-build ({partial} of 24 shards written)"
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["resumed_shards"] >= partial and summary["shards"] == 24
    local = build_dataset(eager_models("llama"), str(prompts), POINTS, tmp_path / "local", layout="token",
                          shard_size=1, progress=False)
    objects = _objects(s3, "resumed")
    assert sorted(objects) == sorted([f.name for f in local.files] + ["_manifest.json"])  # no leftovers
    assert all(objects[f.name] == f.read_bytes() for f in local.files)
