"""Cancellation (issue 27): a cancelled capture must stop the work it started — between decode
steps on eager, on its replica on a cluster, and in a vLLM replica's wait — so the next call
returns promptly and exactly (``torch.equal``: the same computation) what it returned before.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from interp_engine import load_model

from .oracles import assert_same

POINTS = ["resid_post.1", "z.2", "logits"]

#: long enough that a generation takes many times as long as one decode step (the model holds 256)
LONG = 200
#: the cancelled captures in flight at once (the issue's case: 6 x max_tokens=120)
CANCELLED = 6


def _capture(model, tokens, **options):
    return asyncio.run(model.capture(tokens, POINTS, **options))


async def _cancel_then_capture(model, tokens, settle: float):
    """Start ``CANCELLED`` long generations, cancel them once the first is decoding, then time
    the next capture: how long the model stays busy with work nobody waits for."""
    tasks = [asyncio.create_task(model.capture(tokens, POINTS, max_tokens=LONG, stop_at_eos=False))
             for _ in range(CANCELLED)]
    await asyncio.sleep(settle)
    assert not any(t.done() for t in tasks), "the generations finished before they could be cancelled"
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    start = time.perf_counter()
    after = await model.capture(tokens, POINTS)
    return time.perf_counter() - start, after


def _check_cancel_stops_the_work(model, tokens):
    """The capture after the cancelled ones waits at most half of one long generation (100 of its
    decode steps); a model that finished the cancelled work first would take ``CANCELLED`` whole
    generations. And it returns exactly what it returned before."""
    before = _capture(model, tokens)
    start = time.perf_counter()
    _capture(model, tokens, max_tokens=LONG, stop_at_eos=False)
    full = time.perf_counter() - start
    waited, after = asyncio.run(_cancel_then_capture(model, tokens, settle=full / 4))
    assert waited < full / 2, f"the next capture waited {waited:.2f} s; one whole generation takes {full:.2f} s"
    assert_same(after, before)
    return full, waited


def test_cancelled_captures_stop_on_eager(eager_models):
    model = eager_models("llama")
    _check_cancel_stops_the_work(model, model.to_tokens("The quick brown fox"))


def test_cancelled_generation_stops_on_eager(eager_models):
    """``capture_generation_async`` too: a cancelled one stops between decode steps, and the
    generation after it is the one the model gave before."""
    model = eager_models("llama")
    tokens = model.to_tokens("jumps over")

    async def scenario():
        want = await model.capture_generation_async(tokens, POINTS, max_tokens=8)
        start = time.perf_counter()
        await model.capture_generation_async(tokens, POINTS, max_tokens=LONG, stop_at_eos=False)
        full = time.perf_counter() - start
        task = asyncio.create_task(model.capture_generation_async(tokens, POINTS, max_tokens=LONG, stop_at_eos=False))
        await asyncio.sleep(full / 4)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        start = time.perf_counter()
        got = await model.capture_generation_async(tokens, POINTS, max_tokens=8)
        return full, time.perf_counter() - start, want, got

    full, waited, (want_completion, want), (got_completion, got) = asyncio.run(scenario())
    assert waited < full / 2, f"the next generation waited {waited:.2f} s; one whole generation takes {full:.2f} s"
    assert got_completion == want_completion
    assert_same(got.to_dict(), want.to_dict())


@pytest.fixture(scope="module")
def cluster_llama(tiny_path):
    ray = pytest.importorskip("ray")
    from interp_engine.loopback import start_local_ray

    start_local_ray(num_cpus=2)  # a new local Ray, never one another process started on this machine
    model = load_model(str(tiny_path("llama")), replicas=1, cpus_per_replica=1, torch_threads=1)
    yield model
    model.close()
    ray.shutdown()


def test_cancelled_captures_stop_on_a_cluster(cluster_llama):
    """A cancelled await cancels the request on the cluster: the running generation stops between
    decode steps on its replica and the queued ones never start."""
    _check_cancel_stops_the_work(cluster_llama, cluster_llama.to_tokens("The quick brown fox"))


def test_a_vllm_replica_wait_aborts_under_a_stop_check(tiny_path):
    """What a vLLM replica runs: a synchronous generation under a stop check (Ray's cancellation
    flag there; an event here). Once the check answers True the wait ends, the engine aborts the
    request, and the engine serves the next call exactly as before."""
    import threading

    pytest.importorskip("vllm")
    from interp_engine import cancel, capture_generation

    model = load_model(str(tiny_path("llama")), backend="vllm", max_model_len=LONG + 32)
    try:
        tokens = model.to_tokens("The quick brown fox")
        want = capture_generation(model, tokens, POINTS, max_tokens=8)
        start = time.perf_counter()
        capture_generation(model, tokens, POINTS, max_tokens=LONG, stop_at_eos=False)
        full = time.perf_counter() - start
        stop = threading.Event()
        threading.Timer(full / 4, stop.set).start()
        start = time.perf_counter()
        with cancel.watching(stop.is_set), pytest.raises(cancel.Cancelled, match="cancelled by its caller"):
            capture_generation(model, tokens, POINTS, max_tokens=LONG, stop_at_eos=False)
        assert time.perf_counter() - start < full * 3 / 4
        got = capture_generation(model, tokens, POINTS, max_tokens=8)
        assert got[0] == want[0]
        assert_same(got[1].to_dict(), want[1].to_dict())
    finally:
        model.close()


# -- analysis helpers on caches that lack what they need ------------------------------------------
