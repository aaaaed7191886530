"""Shared fixtures: tiny random models (built once per session) and the loaded eager models."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from . import devices, markers, tiny, tiny_moe, tiny_recent


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="device of the eager test models (tests/devices.py); cuda skips the CPU-only modules")


def pytest_configure(config):
    """vLLM-CPU engines in the tests reserve a 1 GiB KV cache (its default is 4 GiB per engine,
    and several engines live at once). On CUDA, fp32 stays fp32: no TF32 matmuls."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    devices.DEVICE = config.getoption("--device")
    if devices.DEVICE == "cuda":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    for item in items:  # vllm / ray / s3 / slow, from one table (tests/markers.py)
        callspec = getattr(item, "callspec", None)
        for mark in sorted(markers.markers_of(item.module.__name__.rsplit(".", 1)[-1],
                                              callspec.params if callspec else {}, item.fixturenames)):
            item.add_marker(getattr(pytest.mark, mark))
    if devices.DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason="not a device test module (tests/devices.py MODULES); runs on the CPU only")
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] not in devices.MODULES:
            item.add_marker(skip)


#: the packages that are the oracle of some test module (the `test` extra): where one does not
#: import, its tests skip; on CI (``CI=true``) that is a failure, not a pass
ORACLES = ("sae_lens", "datasets", "duckdb", "moto")


def missing_oracles() -> list[str]:
    """``"name: why"`` for each of :data:`ORACLES` that does not import here."""
    missing = []
    for name in ORACLES:
        try:
            importlib.import_module(name)
        except ImportError as err:
            missing.append(f"{name}: {err}")
    return missing


def pytest_collection_finish(session):
    """On CI, every oracle package must import (a skipped oracle module would pass CI silently:
    TransformerLens 4 in the test venv breaks ``import sae_lens``). Then, when engines will start
    (the items left after ``-m`` deselection), vLLM's per-class inspection runs for every fixture
    family at once, in the background (tests/vllm_warm.py), instead of in a subprocess per family."""
    if os.environ.get("CI", "").lower() in ("true", "1") and (missing := missing_oracles()):
        pytest.exit("CI=true and test oracles do not import, so their tests would skip: " + "; ".join(missing)
                    + ". Install the test extra into this venv (pip install -e '.[test]'); keep the bench "
                    "extra out of it (make bench uses .venv-bench)", returncode=1)
    config = session.config
    if importlib.util.find_spec("vllm") is None or not any(i.get_closest_marker("vllm") for i in session.items):
        return
    config._vllm_warm = subprocess.Popen([sys.executable, "-m", "tests.vllm_warm"], cwd=config.rootpath,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_unconfigure(config):
    warm = getattr(config, "_vllm_warm", None)
    if warm is not None and warm.poll() is None:
        warm.kill()
        warm.wait()


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_path(tiny_root):
    """``tiny_path(family)`` -> folder of a tiny random model of that family (dense, MoE or
    multi-stream)."""
    def build(family):
        if family in tiny_recent.FAMILIES:
            return tiny_recent.build(family, tiny_root)
        return (tiny_moe if family in tiny_moe.MOE_FAMILIES + tiny_moe.STREAM_FAMILIES else tiny).build(family, tiny_root)

    return build


@pytest.fixture(scope="session")
def eager_models(tiny_path):
    """``eager_models(family)`` -> a shared eager model of that family."""
    from interp_engine import load_model

    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = load_model(str(tiny_path(family)), backend="eager", **devices.load_kwargs())
        return loaded[family]

    return get


def pytest_terminal_summary(terminalreporter):
    """The docs snippet runner's tally (tests/test_docs.py), when it was collected."""
    import sys

    docs = sys.modules.get(f"{__package__}.test_docs")
    if docs is not None:
        terminalreporter.write_line(docs.summary())
