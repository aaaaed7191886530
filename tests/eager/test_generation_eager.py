"""capture_generation and the async capture on the eager backend."""

import asyncio

import pytest
import torch

from interp_engine import Address, capture_generation, run_with_cache

from .. import sampling_checks

POINTS = ["resid_post.1", "z.2", "q.0", "k.1", "v.2", "pattern.1", "logits"]


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("qwen3")


def test_generation_cache_equals_one_forward_over_the_fed_tokens(model):
    tokens = model.to_tokens("Once upon")
    completion, cache = capture_generation(model, tokens, POINTS, max_tokens=6)
    assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
    n = tokens.shape[1] + len(completion.token_ids) - 1
    assert cache.tokens.shape == (1, n)
    assert cache.tokens[0, : tokens.shape[1]].tolist() == tokens[0].tolist()
    assert cache.tokens[0, tokens.shape[1]:].tolist() == completion.token_ids[:-1]
    full = run_with_cache(model, cache.tokens, POINTS)
    for a in POINTS:
        assert cache[a].shape == full[a].shape
        torch.testing.assert_close(cache[a], full[a], atol=1e-5, rtol=1e-5)
    # greedy: each generated token is the argmax of the logits at the previous position
    assert full["logits"][0, tokens.shape[1] - 1 :].argmax(-1).tolist() == completion.token_ids


def test_sampling_with_seed_is_reproducible(model):
    tokens = model.to_tokens("Once upon")
    a, _ = capture_generation(model, tokens, ["resid_post.0"], max_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    b, _ = capture_generation(model, tokens, ["resid_post.0"], max_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    assert a.token_ids == b.token_ids


def test_async_capture_is_a_plain_dict_keyed_by_address(model):
    prompts = ["a", "bb bb", "ccc ccc ccc"]

    async def main():
        return await asyncio.gather(*(model.capture(model.to_tokens(p), ["resid_post.1"]) for p in prompts))

    results = asyncio.run(main())
    for prompt, got in zip(prompts, results):
        assert type(got) is dict
        with pytest.raises(KeyError):
            got["resid_post.1"]
        ref = run_with_cache(model, model.to_tokens(prompt), ["resid_post.1"])
        assert torch.equal(got[Address("resid_post", 1)], ref.get("resid_post", 1))


def test_captured_tensors_can_train_a_probe(model):
    """Captures are ordinary tensors (not inference-mode ones), so a probe trains on them."""
    _, generated = capture_generation(model, model.to_tokens("probe"), ["resid_post.1"], max_tokens=2)
    for cache in (run_with_cache(model, model.to_tokens("probe me"), ["resid_post.1"]), generated):
        x = cache.get("resid_post", 1)
        assert not x.is_inference() and not x.requires_grad
        probe = torch.nn.Linear(x.shape[-1], 1, device=x.device)
        probe(x).sum().backward()
        assert probe.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("check", sampling_checks.PROPERTIES, ids=lambda check: check.__name__)
def test_sampling(model, check):
    """What temperature, top-k, top-p and seed mean (tests/sampling_checks.py)."""
    check(model)


def _logprobs_of(cache, prompt: int, completion, top: int):
    """The oracle: log_softmax of the captured logits at each position that chose a token."""
    steps = torch.log_softmax(cache["logits"][0, prompt - 1:].double(), dim=-1)
    sampled = [float(steps[i, t]) for i, t in enumerate(completion.token_ids)]
    values, ids = torch.topk(steps, top, dim=-1)
    return sampled, [dict(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]


@pytest.mark.parametrize("options", [{}, {"temperature": 1.5, "top_k": 5, "seed": 2}])
def test_logprobs_are_log_softmax_of_the_captured_logits(model, options):
    """Each generated token's logprob, and each step's top 4, equal log_softmax of the logits that
    chose it (the model's own distribution: temperature and top-k do not change them)."""
    tokens = model.to_tokens("Once upon")
    completion, cache = capture_generation(model, tokens, ["logits"], max_tokens=6, top_logprobs=4, **options)
    sampled, top = _logprobs_of(cache, tokens.shape[1], completion, 4)
    assert len(completion.logprobs) == len(completion.token_ids) == len(completion.top_logprobs) == 6
    torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64),
                               torch.tensor(sampled, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    for step, (got, want) in enumerate(zip(completion.top_logprobs, top)):
        assert list(got) == list(want), f"step {step}: top tokens {list(got)} != {list(want)}"
        torch.testing.assert_close(torch.tensor(list(got.values()), dtype=torch.float64),
                                   torch.tensor(list(want.values()), dtype=torch.float64), atol=1e-5, rtol=1e-5)
    if not options:  # greedy: the sampled token is the most likely one
        assert [next(iter(step)) for step in completion.top_logprobs] == completion.token_ids
    plain, _ = capture_generation(model, tokens, ["logits"], max_tokens=6, **options)
    assert plain.top_logprobs is None and plain.logprobs == pytest.approx(completion.logprobs, abs=1e-6)


def test_stream_yields_the_tokens_and_captures_of_capture_generation(model):
    """Each streamed step is the token capture_generation chooses (same logprobs), with the
    captures of the forward that chose it: concatenated, they are capture_generation's cache."""
    from interp_engine.address import parse_address

    tokens = model.to_tokens("Once upon")
    points = ["resid_post.1", "z.2", "logits"]
    completion, cache = capture_generation(model, tokens, points, max_tokens=5, top_logprobs=2)

    async def collect():
        return [step async for step in model.stream(tokens, points, max_tokens=5, top_logprobs=2)]

    steps = asyncio.run(collect())
    assert [s.token_id for s in steps] == completion.token_ids and [s.index for s in steps] == list(range(5))
    assert [s.logprob for s in steps] == completion.logprobs
    assert [s.top_logprobs for s in steps] == completion.top_logprobs
    assert "".join(s.text for s in steps) == completion.text
    assert steps[0].captures[parse_address("z.2")].shape[1] == tokens.shape[1]  # the prompt's forward
    assert steps[1].captures[parse_address("z.2")].shape[1] == 1                # then one position a step
    for point in points:
        streamed = torch.cat([s.captures[parse_address(point)] for s in steps], dim=1)
        assert torch.equal(streamed[:, :cache[point].shape[1]], cache[point]), point

    async def two_then_close():
        stream = model.stream(tokens, points, max_tokens=200)
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return got

    assert [s.token_id for s in asyncio.run(two_then_close())] == completion.token_ids[:2]
    again, _ = capture_generation(model, tokens, ["logits"], max_tokens=2)  # the model is free again
    assert again.token_ids == completion.token_ids[:2]
