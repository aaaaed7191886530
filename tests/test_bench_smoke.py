"""Each benchmark still runs: bench/*.py at the smallest sizes their options allow, on the embedded
SmolLM2 (numbers are not checked: benchmarks are not timed tests). The vLLM, Ray and peer
benchmarks are listed with why they do not run here, so a new script must be placed in one table."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

#: script -> (smoke arguments, a line its output must contain)
SMOKE = {
    "eager_capture.py": (["--reps", "1", "--warmup", "0", "--batch", "1", "--seq", "8"], "ratios to `plain`"),
    "dataset_formats.py": (["--prompts", "2"], "(bytes/value)"),
    "features.py": (["--parts", "dashboard", "--prompts", "2", "--reps", "1"], '"tokens_per_s"'),
    "stream.py": (["--reps", "1", "--prompts", "2"], "stream / prefill rate"),
}
#: script -> why the suite does not run it (each takes a vLLM engine, a Ray cluster or both, 30 s to minutes)
NOT_HERE = {
    "peers.py": "needs TransformerLens 4 and nnsight, which live in .venv-bench only (make bench)",
    "vllm_capture.py": "a SmolLM2 vLLM engine", "vllm_scaling.py": "a SmolLM2 vLLM engine",
    "edits_vllm.py": "a SmolLM2 vLLM engine", "positions_vllm.py": "a SmolLM2 vLLM engine",
    "build_throughput.py": "vLLM engines and a Ray cluster", "cluster_dataset.py": "Ray clusters of replicas",
    "dataset_scale.py": "a Ray cluster of replicas", "service.py": "a Ray Serve deployment",
    "service_connect.py": "a Ray Serve deployment",
    "peer_points.py": "the peer engine in a venv of its own (tests/test_peer_points.py runs its pure parts)",
    "peer_side.py": "runs inside the peer engine's venv, started by peer_points.py",
}
#: modules the benchmarks import, not scripts
HELPERS = {"timing.py", "rss.py", "peer_names.py"}


def test_every_benchmark_is_in_one_table():
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")}
    tables = [set(SMOKE), set(NOT_HERE), HELPERS]
    assert scripts == set().union(*tables) and sum(map(len, tables)) == len(scripts)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_at_tiny_sizes(script, monkeypatch, capsys):
    """Run as ``python bench/SCRIPT ARGS`` would (``__main__``, its folder first on the path), in
    this process: the interpreter and the imports are paid once for all of them."""
    args, says = SMOKE[script]
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setattr(sys, "argv", [f"bench/{script}", *args])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    assert says in capsys.readouterr().out
