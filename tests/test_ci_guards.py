"""What keeps the suite honest on CI: an oracle package that does not import fails the run instead
of skipping its tests (tests/conftest.py), and ``make bench`` installs its peers into their own venv,
never the test venv (TransformerLens 4 there breaks ``import sae_lens``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collect(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/core/test_protocol.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_an_oracle_that_does_not_import_fails_ci_and_only_ci(tmp_path):
    broken = tmp_path / "sae_lens"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('transformer-lens 4 replaced transformer-lens<4')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("CI", None)
    assert _collect(env).returncode == 0
    done = _collect({**env, "CI": "true"})
    assert done.returncode == 1, done.stdout[-2000:]
    assert "sae_lens: transformer-lens 4 replaced" in done.stdout + done.stderr


def test_make_bench_keeps_the_peers_out_of_the_test_venv():
    plan = subprocess.run(["make", "-n", "-B", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    installs = [line for line in plan.stdout.splitlines() if "pip install" in line]
    bench = [line for line in installs if "bench" in line.split("pip install", 1)[1]]
    assert bench and all(line.startswith(".venv-bench/") for line in bench), installs
    assert any(line.startswith(".venv-bench/bin/python bench/peers.py") for line in plan.stdout.splitlines())
