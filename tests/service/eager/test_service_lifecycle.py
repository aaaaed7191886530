"""A service's name outliving its deployment (issue 35): a second ``serve()`` of a running name is
refused unless ``replace=True``; a Ray client connected before a replacement gets the old model's
answers or ``ServiceChanged``, never the new model's; a Ray client of a shut-down service fails
with a clear error instead of waiting forever. One service, deployed twice on the package's
loopback Ray (conftest.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from interp_engine import ServiceChanged, ServiceError, connect, run_with_cache, serve, shutdown
from interp_engine.compare import relative_error

from ...oracles import assert_near
from .served import REPLICA

ray = pytest.importorskip("ray")

NAME = "tiny-swap"
POINTS = ["resid_post.1", "logits"]


def test_a_replaced_or_shut_down_service_is_an_error_never_another_model(cluster, tiny_path, eager_models):
    llama, qwen2 = eager_models("llama"), eager_models("qwen2")
    tokens = llama.to_tokens("Hello there")
    want = {name: run_with_cache(model, tokens, POINTS)["resid_post.1"] for name, model in
            (("llama", llama), ("qwen2", qwen2))}
    assert relative_error(want["llama"], want["qwen2"]) > 0.1  # the oracle: a swapped model would show
    serve(str(tiny_path("llama")), name=NAME, replicas=1, **REPLICA)
    try:
        before = connect(NAME)
        assert_near(run_with_cache(before, tokens, POINTS)["resid_post.1"], want["llama"], "before the swap")
        with pytest.raises(ServiceError, match=rf"'{NAME}' already runs.*replace=True"):
            serve(str(tiny_path("qwen2")), name=NAME, replicas=1, **REPLICA)
        assert_near(run_with_cache(before, tokens, POINTS)["resid_post.1"], want["llama"], "after the refusal")

        serve(str(tiny_path("qwen2")), name=NAME, replicas=1, replace=True, **REPLICA)
        deadline = time.monotonic() + 120  # an old replica may still answer for a moment: as the old model
        while True:
            try:
                got = run_with_cache(before, tokens, POINTS)["resid_post.1"]
            except ServiceChanged as err:
                changed = err
                break
            assert_near(got, want["llama"], "a client of the replaced deployment")
            assert time.monotonic() < deadline, "the replaced deployment still answers"
            time.sleep(0.5)
        assert "llama" in str(changed) and "qwen2" in str(changed)
        for field in ("deploy_id", "model", "weights_sha256"):
            assert field in str(changed), field
        assert f"connect({NAME!r})" in str(changed)
        after = connect(NAME)
        assert_near(run_with_cache(after, tokens, POINTS)["resid_post.1"], want["qwen2"], "a new connection")
    finally:
        shutdown(NAME)
    started = time.monotonic()
    with pytest.raises(ServiceError, match=rf"'{NAME}' is gone from this cluster.*connect again"):
        run_with_cache(after, tokens, POINTS)
    with pytest.raises(ServiceError, match=rf"'{NAME}' is gone from this cluster"):
        asyncio.run(after.capture(tokens, POINTS))
    assert time.monotonic() - started < 60  # within a few of the client's alive checks, not forever
