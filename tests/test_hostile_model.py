"""Hostile use of the model side (issue 27): cancelled captures that must stop the work, analysis
helpers given a cache that lacks what they need (or arguments out of range), caches loaded from
inconsistent or damaged files, and a tuple given as ``points``.

Each refusal is a project error (an ``InputError`` subclass) whose message names what is wrong
and how to fix it; after each, the model returns exactly (``torch.equal``: the same computation)
what it returned before.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from interp_engine import InputError, load_model, run_with_cache

POINTS = ["resid_post.1", "z.2", "logits"]
#: long enough that a generation takes many times as long as one decode step (the model holds 256)
LONG = 200
#: the cancelled captures in flight at once (the issue's case: 6 x max_tokens=120)
CANCELLED = 6


def _capture(model, tokens, **options):
    return asyncio.run(model.capture(tokens, POINTS, **options))


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for address, tensor in want.items():
        assert torch.equal(got[address], tensor), address


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
    _assert_same(after, before)
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
    _assert_same(got.to_dict(), want.to_dict())


@pytest.fixture(scope="module")
def cluster_llama(tiny_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    model = load_model(str(tiny_path("llama")), replicas=1, cpus_per_replica=1, torch_threads=1)
    yield model
    model.close()
    ray.shutdown()


def test_cancelled_captures_stop_on_a_cluster(cluster_llama):
    """A cancelled await cancels the request on the cluster: the running generation stops between
    decode steps on its replica and the queued ones never start."""
    _check_cancel_stops_the_work(cluster_llama, cluster_llama.to_tokens("The quick brown fox"))
