"""Serving behaviour of the vLLM backend on one shared tiny Llama engine: concurrent async
captures, warm-up hygiene, sampling, and bad inputs (each a clear error, after which the same
engine still serves). The oracle for "still serves" and for concurrency is a capture of the
same prompt alone on the same engine, and the eager backend on the same weights."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from interp_engine import Address, AddressError, InputError, capture_generation, load_model, run_with_cache

from .. import sampling_checks
from ..probes import engine_state

pytest.importorskip("vllm")

POINTS = ["resid_post.1", "z.2", "mlp_out.0", "logits"]
MAX_LEN = 128


@pytest.fixture(scope="module")
def model(tiny_path):
    with load_model(str(tiny_path("llama")), backend="vllm", max_model_len=MAX_LEN) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def reference(model):
    """A capture of one prompt made alone, to compare later captures against."""
    tokens = model.to_tokens("still serving?")
    return tokens, run_with_cache(model, tokens, POINTS)


def assert_serves(model, reference) -> None:
    tokens, want = reference
    got = run_with_cache(model, tokens, POINTS)
    for point in POINTS:
        torch.testing.assert_close(got[point], want[point], rtol=1e-5, atol=1e-5)


def test_warm_up_leaves_nothing(model):
    # First thing on a fresh engine: start-up and profile runs registered nothing and left no hook.
    for rank in engine_state(model):
        assert rank["pending"] == [] and rank["hooks"] == 0 and rank["max_batch"] == 0
    tokens = model.to_tokens("first")
    cache = run_with_cache(model, tokens, ["resid_pre.0", "logits"])
    assert cache["resid_pre.0"].shape == (1, tokens.shape[1], model.d_model)
    # plain generation through the same engine records nothing either
    from vllm import SamplingParams

    model.llm.generate([{"prompt_token_ids": [256, 65, 66]}], SamplingParams(max_tokens=3), use_tqdm=False)
    for rank in engine_state(model):
        assert rank["pending"] == [] and rank["hooks"] == 0


def test_concurrent_async_captures_each_get_their_own_rows(model):
    prompts = [model.to_tokens("x" * (i % 7) + f"prompt number {i}" + "!" * (i // 4)) for i in range(32)]
    assert len({p.shape[1] for p in prompts}) > 10

    async def all_at_once():
        return await asyncio.gather(*(model.capture(p, POINTS) for p in prompts))

    results = asyncio.run(all_at_once())
    assert max(rank["max_batch"] for rank in engine_state(model)) > 1  # they really shared forwards
    for tokens, got in zip(prompts, results):
        assert type(got) is dict and all(isinstance(key, Address) for key in got)
        with pytest.raises(KeyError):
            got["resid_post.1"]  # the async result is a plain dict keyed by Address
        alone = run_with_cache(model, tokens, POINTS)
        for point in POINTS:
            mine = got[Address(*_split(point))]
            assert mine.shape[1] == tokens.shape[1]
            torch.testing.assert_close(mine, alone[point], rtol=1e-5, atol=1e-5)
    for rank in engine_state(model):
        assert rank["pending"] == [] and rank["hooks"] == 0


def _split(point: str):
    name, *rest = point.split(".")
    return (name, *(int(x) for x in rest))


def test_concurrent_captures_of_different_points_each_get_their_own_rows(model):
    # Requests wanting a site are interleaved with requests that do not, so the recorder selects
    # non-contiguous rows of the flat batch.
    point_sets = [["resid_post.1"], ["z.2", "resid_post.1"], ["logits", "mlp_out.0"]]
    jobs = [(model.to_tokens("mixed " * (1 + i % 5) + str(i)), point_sets[i % 3]) for i in range(12)]

    async def all_at_once():
        return await asyncio.gather(*(model.capture(t, points) for t, points in jobs))

    for (tokens, points), got in zip(jobs, asyncio.run(all_at_once())):
        alone = run_with_cache(model, tokens, points)
        assert set(got) == set(alone)
        for address in alone:
            torch.testing.assert_close(got[address], alone[address], rtol=1e-5, atol=1e-5)


def test_concurrent_generations_equal_solo_generations(model):
    prompts = [model.to_tokens(t) for t in ("a", "bb bb", "ccc ccc ccc", "dddd")]

    async def all_at_once():
        return await asyncio.gather(*(model.capture(p, ["resid_post.2"], max_tokens=5 + i)
                                      for i, p in enumerate(prompts)))

    results = asyncio.run(all_at_once())
    for i, (tokens, got) in enumerate(zip(prompts, results)):
        completion, alone = capture_generation(model, tokens, ["resid_post.2"], max_tokens=5 + i)
        assert got[Address("resid_post", 2)].shape[1] == tokens.shape[1] + len(completion.token_ids) - 1
        torch.testing.assert_close(got[Address("resid_post", 2)], alone["resid_post.2"], rtol=1e-5, atol=1e-5)


def test_generation_matches_eager_greedy(model, eager_models):
    eager = eager_models("llama")
    tokens = model.to_tokens("Greedy")
    completion, cache = capture_generation(model, tokens, ["resid_post.1"], max_tokens=12)
    expected, _ = capture_generation(eager, tokens, ["resid_post.1"], max_tokens=12)
    assert completion.token_ids == expected.token_ids
    assert cache.get("resid_post", 1).shape[1] == tokens.shape[1] + len(completion.token_ids) - 1


def test_sampling_with_a_seed_is_reproducible(model):
    tokens = model.to_tokens("Once upon")
    options = dict(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=3)
    a, cache_a = capture_generation(model, tokens, ["resid_post.0"], **options)
    b, cache_b = capture_generation(model, tokens, ["resid_post.0"], **options)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    torch.testing.assert_close(cache_a["resid_post.0"], cache_b["resid_post.0"])
    greedy, _ = capture_generation(model, tokens, ["resid_post.0"], max_tokens=8)
    hot = {tuple(capture_generation(model, tokens, ["resid_post.0"], **{**options, "seed": s})[0].token_ids)
           for s in range(4)}
    assert len(hot | {tuple(greedy.token_ids)}) > 1  # the temperature is used



@pytest.mark.parametrize("check", sampling_checks.PROPERTIES, ids=lambda check: check.__name__)
def test_sampling(model, check):
    """What temperature, top-k, top-p and seed mean, as on the eager backend
    (tests/sampling_checks.py)."""
    check(model)

BAD_INPUTS = {
    "a batch": (lambda m: run_with_cache(m, m.tok.to_tokens(["Paris is in", "Berlin is in"]), POINTS),
                InputError, "model.capture"),
    "pattern": (lambda m: run_with_cache(m, m.to_tokens("hi"), ["pattern.0"]), AddressError, "eager-only"),
    "detach=False": (lambda m: run_with_cache(m, m.to_tokens("hi"), POINTS, detach=False), InputError,
                     "requires_grad=True"),
    "too long": (lambda m: run_with_cache(m, torch.full((1, MAX_LEN + 5), 65), POINTS), InputError,
                 "max_model_len"),
    "longer than the model": (lambda m: run_with_cache(m, torch.full((1, 300), 65), POINTS), InputError,
                              "positions"),
    "unknown site": (lambda m: run_with_cache(m, m.to_tokens("hi"), ["resid_postt.1"]), AddressError,
                     "known sites"),
    "layer out of range": (lambda m: run_with_cache(m, m.to_tokens("hi"), ["resid_post.3"]), AddressError,
                           "0..2"),
    "max_tokens=0": (lambda m: capture_generation(m, m.to_tokens("hi"), POINTS, max_tokens=0), InputError,
                     "max_tokens"),
    "max_tokens<0 async": (lambda m: asyncio.run(m.capture(m.to_tokens("hi"), POINTS, max_tokens=-2)), InputError,
                           "max_tokens"),
    "a batch async": (lambda m: asyncio.run(m.capture(m.tok.to_tokens(["a", "b"]), POINTS)), InputError, "one prompt"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(model, reference, case):
    call, error, says = BAD_INPUTS[case]
    with pytest.raises(error, match=says):
        call(model)
    assert_serves(model, reference)


def test_requires_grad_is_refused_before_an_engine_starts(tiny_path):
    with pytest.raises(ValueError, match="eager-only"):
        load_model(str(tiny_path("llama")), backend="vllm", requires_grad=True)


def test_options_that_would_skip_positions_are_refused(tiny_path):
    with pytest.raises(ValueError, match="compiled graphs"):
        load_model(str(tiny_path("llama")), backend="vllm", compilation_config={"mode": 3})
    with pytest.raises(ValueError, match="replicas"):
        load_model(str(tiny_path("llama")), backend="vllm", pipeline_parallel_size=2)


def test_generation_may_fill_max_model_len_but_not_pass_it(model, reference):
    tokens = torch.full((1, MAX_LEN - 4), 66)
    tokens[0, 0] = 256
    with pytest.raises(InputError, match=f"max_tokens=5 needs {MAX_LEN + 1} positions.*max_model_len={MAX_LEN}.*"
                                         f"max_tokens <= 4"):
        capture_generation(model, tokens, ["resid_post.0"], max_tokens=5)
    completion, cache = capture_generation(model, tokens, ["resid_post.0"], max_tokens=4, stop_at_eos=False)
    assert len(completion.token_ids) == 4 and completion.finish_reason == "length"
    assert cache["resid_post.0"].shape[1] == tokens.shape[1] + len(completion.token_ids) - 1
    assert_serves(model, reference)


def test_a_checkpoint_vllm_would_run_differently_is_refused(tiny_path, model, reference):
    # The shared tiny Qwen2 has head_dim 64 with hidden 128 / 4 heads; vLLM 0.32's Qwen2 ignores
    # head_dim and would compute a different model.
    with pytest.raises(ValueError, match="heads of size 32"):
        load_model(str(tiny_path("qwen2")), backend="vllm", max_model_len=64)
    # That second engine in this process started and was shut down; this one still serves.
    assert_serves(model, reference)


def test_an_abandoned_capture_is_aborted_and_forgotten(model, reference):
    async def start_then_abandon():
        task = asyncio.ensure_future(model.capture(model.to_tokens("long one"), ["resid_post.0"], max_tokens=100,
                                                   stop_at_eos=False))
        deadline = time.monotonic() + 120
        while not any(rank["pending"] for rank in engine_state(model)):  # in flight: the worker holds it
            assert not task.done() and time.monotonic() < deadline, "the capture never reached the engine"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(start_then_abandon())
    assert_serves(model, reference)  # the loop aborted it between steps, then served this
    for rank in engine_state(model):
        assert rank["pending"] == [] and rank["hooks"] == 0


def test_captured_tensors_can_train_a_probe(model):
    cache = run_with_cache(model, model.to_tokens("probe me"), ["resid_post.1"])
    x = cache.get("resid_post", 1)
    assert not x.is_inference()
    probe = torch.nn.Linear(x.shape[-1], 1)
    probe(x).sum().backward()
    assert probe.weight.grad.abs().sum() > 0
