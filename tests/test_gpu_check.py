"""The GPU check script (bench/gpu/check.sh) on the CPU with tiny models: the same code the GPU
run executes, so a session with a GPU spends its device minutes on the run, not on fixing the
script. Its GPU results are in BENCHMARKS.md ("GPU")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_the_cpu_with_tiny_models(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/gpu/check.sh", "--device", "cpu", "--tiny", "--stages", "parity,speed"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parity = json.loads((tmp_path / "parity.json").read_text())
    sites = {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "q", "k", "v", "mlp_post",
             "pattern", "logits"}
    assert set(parity["float32"]) == set(parity["bfloat16"]) == sites
    # the CPU against itself in fp32 is the same computation; bf16 is not
    assert parity["fp32_max"] == 0.0 and parity["fp32_within_bound"]
    assert 0 < parity["bf16_max"] < 0.5
    speed = json.loads((tmp_path / "speed.json").read_text())
    assert set(speed["ratio"]) == {"resid_post", "resid_post_last", "dense", "capture_generation",
                                   "add_every_layer"}
    assert all(t > 0 for t in speed["median_s"].values())
    assert (tmp_path / "env.txt").read_text().count("torch") >= 1


def test_device_option_refuses_an_unknown_device():
    done = subprocess.run([sys.executable, "-m", "pytest", "--device", "tpu", "--collect-only", "-q",
                           "tests/core/test_address.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "invalid choice: 'tpu'" in done.stderr


def test_tests_stage_collects_every_device_module(tmp_path):
    """The tests stage's own collection step (``--stages tests --collect``): every module of
    tests/devices.py's MODULES is found where it lives and collects, so a module that moves or goes
    missing fails here rather than on the GPU machine."""
    from .devices import MODULES

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/gpu/check.sh", "--device", "cpu", "--stages", "tests", "--collect"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    collected = {line.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py") for line in log.splitlines() if "::" in line}
    assert collected == set(MODULES), log[-3000:]
