"""vLLM's limits checked before its engine starts, and its start-up lines quiet (issue 26, item
8). No engine starts here: a model or option the build cannot run is refused from its config;
the quiet start is checked on vLLM's own loggers (tests/vllm/test_tl_vllm.py checks a real engine's
start-up)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from interp_engine import InputError, load_model

pytest.importorskip("vllm")


def _copy_with(tmp_path, source, **changes):
    folder = tmp_path / "changed"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test: the refusal must come first."""
    from interp_engine.backends.vllm import model

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(model, "start_engine", refuse)


def test_a_head_size_the_cpu_kernel_rejects_is_refused_before_the_engine_starts(tmp_path, tiny_path, no_engine):
    from interp_engine.backends.vllm import compat

    if not compat.is_cpu_platform():
        pytest.skip("the CPU build's limit")
    sizes, _ = compat.cpu_attention_limits()
    assert 16 not in sizes and 64 in sizes  # what vLLM 0.32's CPU attention declares
    folder = _copy_with(tmp_path, tiny_path("llama"), head_dim=16)
    with pytest.raises(InputError, match=r"heads of size 16 \(head_dim\), and vLLM's CPU attention kernel takes "
                                         r"head sizes 32, 64, .*backend='eager'"):
        load_model(str(folder), backend="vllm")


def test_a_kv_block_size_the_cpu_kernel_rejects_is_refused_before_the_engine_starts(tiny_path, no_engine):
    from interp_engine.backends.vllm import compat

    if not compat.is_cpu_platform():
        pytest.skip("the CPU build's limit")
    with pytest.raises(InputError, match=r"block_size=16: .* a multiple of 32 tokens; pass block_size=32"):
        load_model(str(tiny_path("llama")), backend="vllm", block_size=16)
    with pytest.raises(AssertionError, match="an engine was started"):  # a multiple of 32 passes the check
        load_model(str(tiny_path("llama")), backend="vllm", block_size=64)
    with pytest.raises(InputError, match="verbose must be True or False"):
        load_model(str(tiny_path("llama")), backend="vllm", verbose="yes")


def test_vllm_lines_are_quiet_while_an_engine_starts_unless_asked(monkeypatch):
    from interp_engine.backends.vllm.engine import quiet_start

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    root = logging.getLogger("vllm")
    root.addHandler(handler)
    before = root.level
    try:
        child = logging.getLogger("vllm.config.model")
        with quiet_start():
            child.info("an info line")
            child.warning("a warning line")
            child.error("an error line")
            import os

            assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"  # what worker processes read
        assert [r.getMessage() for r in seen] == ["an error line"] and root.level == before
        with quiet_start(verbose=True):
            child.warning("shown when verbose")
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
        with quiet_start():  # the user chose a level: left alone
            child.warning("shown at the user's level")
        assert [r.getMessage() for r in seen][1:] == ["shown when verbose", "shown at the user's level"]
    finally:
        root.removeHandler(handler)
