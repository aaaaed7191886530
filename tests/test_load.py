"""Load and cancellation on one vLLM engine (the tiny Llama).

- 200 concurrent mixed requests (prefill captures of two point sets, greedy and seeded sampled
  generations) each equal the same request run alone on the same engine: token ids exactly,
  activations within float tolerance (a different batch composition is a different computation).
- Three rounds of concurrent requests with a third of them cancelled mid-flight: the others still
  equal their solo runs, nothing stays registered or hooked, the engine keeps serving, and no
  tensor outlives its round (the count of live tensors after round 3 is that after round 2; RSS
  only as a gross bound, since allocator noise is no condition to wait for).

The engine starts without ``VLLM_CPU_KVCACHE_SPACE``, so it runs on the KV cache size the backend
derives from the model (vllm_engine.cpu_kv_cache_bytes).
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from interp_engine import load_model, run_with_cache

from .oracles import assert_near
from .probes import engine_state

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

MAX_LEN = 128
POINT_SETS = [["resid_post.1", "logits"], ["z.2", "mlp_out.0"]]


@pytest.fixture(scope="module")
def model(tiny_path):
    env = pytest.MonkeyPatch()
    env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the backend's own default, under load
    try:
        loaded = load_model(str(tiny_path("llama")), backend="vllm", max_model_len=MAX_LEN)
    finally:
        env.undo()
    with loaded:
        yield loaded


def jobs(model, n: int, *, long: bool = False) -> list[tuple]:
    """``n`` mixed requests: (tokens, points, sampling or None)."""
    out = []
    for i in range(n):
        tokens = model.to_tokens(f"request {i}: " + "ab " * (i % 9) + "!" * (i % 4))
        kind = i % 4
        if kind < 2:
            out.append((tokens, POINT_SETS[kind], None))
        else:
            new = 40 if long else 2 + i % 5
            sampling = dict(max_tokens=new, stop_at_eos=False)
            if kind == 3:
                sampling.update(temperature=0.8, top_p=0.9, top_k=40, seed=i)
            out.append((tokens, ["resid_post.2"], sampling))
    return out


async def request(model, job):
    tokens, points, sampling = job
    if sampling is None:
        return None, await model.capture(tokens, points)
    completion, cache = await model.capture_generation_async(tokens, points, **sampling)
    return completion, cache.to_dict()


def solo(model, job):
    return asyncio.run(request(model, job))


def assert_same(got, want, what: str) -> None:
    (completion, tensors), (completion_alone, tensors_alone) = got, want
    if completion_alone is not None:
        assert completion.token_ids == completion_alone.token_ids, what
        assert completion.finish_reason == completion_alone.finish_reason, what
    assert list(tensors) == list(tensors_alone), what
    for address, tensor in tensors_alone.items():
        assert_near(tensors[address], tensor, f"{what} {address}", rel=1e-5)


def assert_idle(model) -> None:
    for rank in engine_state(model):
        assert rank["pending"] == [] and rank["hooks"] == 0, rank


def test_the_engine_runs_on_the_kv_cache_sized_from_the_model(model):
    from interp_engine.backends.vllm.engine import DEFAULT_FLOOR, cpu_kv_cache_bytes, kv_bytes_per_token

    chosen = model.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
    # the tiny model's 8 full-length sequences are far below the floor, so the floor is the size
    assert kv_bytes_per_token(model.info, torch.float32) * MAX_LEN * 8 < DEFAULT_FLOOR
    assert chosen == cpu_kv_cache_bytes(model.info, torch.float32, MAX_LEN) == DEFAULT_FLOOR


def test_200_concurrent_mixed_requests_each_equal_their_solo_run(model):
    work = jobs(model, 200)

    async def all_at_once():
        return await asyncio.gather(*(request(model, job) for job in work))

    together = asyncio.run(all_at_once())
    assert max(rank["max_batch"] for rank in engine_state(model)) > 8  # they really shared forwards
    assert_idle(model)
    for i, (job, got) in enumerate(zip(work, together)):
        assert_same(got, solo(model, job), f"request {i}")
    lengths = {i: len(got[0].token_ids) for i, got in enumerate(together) if got[0] is not None}
    assert lengths == {i: 2 + i % 5 for i in range(200) if i % 4 >= 2}  # 100 generations, EOS ignored


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _live_tensors() -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def test_cancelling_a_third_mid_flight_leaves_serving_and_memory_intact(model):
    work = jobs(model, 48, long=True)
    alone = [solo(model, job) for job in work]
    probe = model.to_tokens("still serving?")
    reference = run_with_cache(model, probe, POINT_SETS[0])

    async def round_with_cancellations():
        tasks = [asyncio.ensure_future(request(model, job)) for job in work]
        while sum(t.done() for t in tasks) < 4:  # mid-flight: some finished, the long ones running
            await asyncio.sleep(0.005)
        doomed = [t for i, t in enumerate(tasks) if i % 3 == 1 and not t.done()]
        for task in doomed:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return tasks, doomed

    rss = []
    for round_ in range(3):
        tasks, doomed = asyncio.run(round_with_cancellations())
        assert len(doomed) >= 8 and all(t.cancelled() for t in doomed), f"round {round_}: {len(doomed)} cancelled"
        for i, (task, want) in enumerate(zip(tasks, alone)):
            if task not in doomed:
                assert_same(task.result(), want, f"round {round_}, request {i}")
        assert_idle(model)
        again = run_with_cache(model, probe, POINT_SETS[0])
        for address in reference:
            assert torch.equal(again[address], reference[address]), address
        del tasks, doomed, again
        rss.append((_rss(), _live_tensors()))
    assert rss[2][1] <= rss[1][1], f"live tensors per round: {[n for _, n in rss]}"  # round 1 warms up
    assert rss[2][0] <= 1.5 * rss[0][0], f"RSS per round (MiB): {[r >> 20 for r, _ in rss]}"
