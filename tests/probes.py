"""Probes into a running vLLM capture engine, for tests and benchmarks (not public API)."""

from __future__ import annotations

from interp_engine.backends.vllm.loop import run_on_loop


def engine_state(model) -> list[dict]:
    """Per rank of a vLLM model: ``pending`` requests, ``hooks`` installed now, ``edited``
    requests, ``max_batch`` (most captures seen in one forward), ``bytes_returned`` (the rows
    handed to the driver so far). An idle engine holds no requests and no hooks."""
    return run_on_loop(model._loop, "interp_state")
