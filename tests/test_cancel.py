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


class Forwards:
    """Counts the forwards of an eager model (one per prefill or decode step), so a test waits for
    a condition — a generation is decoding — and measures work in steps, not seconds."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.hf.register_forward_pre_hook(lambda *_: setattr(self, "n", self.n + 1))

    async def until(self, n: int, timeout: float = 120.0) -> None:
        """Wait until ``n`` forwards have started, then note the count (``at``) for the cancel."""
        deadline = time.monotonic() + timeout
        while self.n < n:
            assert time.monotonic() < deadline, f"{self.n} forwards after {timeout:g} s, waiting for {n}"
            await asyncio.sleep(0.001)
        self.at = self.n

    def close(self) -> None:
        self.handle.remove()


async def _cancel_then_capture(model, tokens, started):
    """Start ``CANCELLED`` long generations, cancel them once ``started()`` (awaited) returns, then
    give the next capture."""
    tasks = [asyncio.create_task(model.capture(tokens, POINTS, max_tokens=LONG, stop_at_eos=False))
             for _ in range(CANCELLED)]
    await started()
    assert not any(t.done() for t in tasks), "the generations finished before they could be cancelled"
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return await model.capture(tokens, POINTS)


def test_cancelled_captures_stop_on_eager(eager_models):
    """Cancelled once the first of 6 long generations decodes: from the cancel on, at most a step in
    flight and the next capture's one forward run (not the 6 x 200 steps nobody waits for), and the
    next capture returns exactly what it did before."""
    model = eager_models("llama")
    tokens = model.to_tokens("The quick brown fox")
    before = _capture(model, tokens)
    forwards = Forwards(model)
    try:
        after = asyncio.run(_cancel_then_capture(model, tokens, lambda: forwards.until(3)))
    finally:
        forwards.close()
    assert forwards.n - forwards.at <= 3, f"{forwards.n - forwards.at} forwards after the cancel: the work went on"
    assert_same(after, before)


def test_cancelled_generation_stops_on_eager(eager_models):
    """``capture_generation_async`` too: a cancelled one stops between decode steps (counted), and
    the generation after it is the one the model gave before."""
    model = eager_models("llama")
    tokens = model.to_tokens("jumps over")

    async def scenario(forwards):
        want = await model.capture_generation_async(tokens, POINTS, max_tokens=8)
        own = forwards.n  # the forwards of that generation
        task = asyncio.create_task(model.capture_generation_async(tokens, POINTS, max_tokens=LONG, stop_at_eos=False))
        await forwards.until(own + 3)  # decoding
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        got = await model.capture_generation_async(tokens, POINTS, max_tokens=8)
        return forwards.n - forwards.at - own, want, got

    forwards = Forwards(model)
    try:
        more, (want_completion, want), (got_completion, got) = asyncio.run(scenario(forwards))
    finally:
        forwards.close()
    assert more <= 2, f"the cancelled generation ran {more} more forwards after the cancel"
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
    decode steps on its replica and the queued ones never start. The replica's steps cannot be
    counted from here, so this one is timed: the next capture waits less than one whole long
    generation, where a replica that finished the cancelled work would take about six."""
    model, tokens = cluster_llama, cluster_llama.to_tokens("The quick brown fox")
    before = _capture(model, tokens)
    start = time.perf_counter()
    _capture(model, tokens, max_tokens=LONG, stop_at_eos=False)
    full = time.perf_counter() - start

    start = time.perf_counter()  # a quarter of a generation in, the first one is on the replica
    after = asyncio.run(_cancel_then_capture(model, tokens, lambda: asyncio.sleep(full / 4)))
    waited = time.perf_counter() - start - full / 4
    assert waited < full, f"the next capture waited {waited:.2f} s; one whole generation takes {full:.2f} s"
    assert_same(after, before)


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
