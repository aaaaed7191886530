"""Prefix caching and chunked prefill on the vLLM backend (docs/VLLM.md, "Prefix caching and
chunked prefill"): a request reads cached blocks only before the first position it captures or
edits (interp_engine/backends/vllm/prefix.py), and a prompt longer than a step's token budget is
prefilled over several forwards whose rows join into one capture.

Oracles: the eager backend on the same weights (rel 1e-4), and vLLM's own count of the prompt
tokens each request took from the prefix cache (``RequestOutput.num_cached_tokens``), which says
that a request really hit the cache (or really did not). The prompts share a prefix of two full
KV blocks (``block_size=32``); a step computes at most ``BUDGET`` tokens.
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import Add, capture_generation, load_model, run_with_cache
from interp_engine.backends.vllm.loop import Job, run_on_loop
from interp_engine.backends.vllm.sampling import sampling_params as _sampling_params

from ..oracles import assert_near

pytest.importorskip("vllm")

BLOCK = 32
PREFIX = 2 * BLOCK
BUDGET = 48
POINTS = ["resid_pre.0", "attn_out.1", "resid_post.2", "k.1", "logits"]


@pytest.fixture(scope="module")
def models(tiny_path, eager_models):
    with load_model(str(tiny_path("llama")), backend="vllm", max_model_len=256, block_size=BLOCK,
                    max_num_batched_tokens=BUDGET, max_num_seqs=8) as model:
        yield model, eager_models("llama")


def prompt(seed: int, prefix: int = 0) -> torch.Tensor:
    """A shared prefix (from ``prefix``) and 9 tokens of its own (from ``seed``)."""
    shared = torch.randint(3, 250, (PREFIX,), generator=torch.Generator().manual_seed(1000 + prefix))
    own = torch.randint(3, 250, (9,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([shared, own])[None]


def capture(model, tokens, points, **kwargs):
    """``run_with_cache`` through the engine (no points: a plain prefill, nothing registered), and
    how many prompt tokens vLLM took from its cache."""
    if not points:
        job = Job(tokens[0].tolist(), _sampling_params(None))
        return None, model._loop.submit(job).result(timeout=120).output.num_cached_tokens
    request = model.request(tokens, points, **kwargs)
    finished = model._submit(request).result(timeout=120)
    return model._result(finished, request), finished.output.num_cached_tokens


def check(cache, eager, tokens, points, what, positions=None, edits=None):
    want = run_with_cache(eager, tokens, points, positions=positions, edits=edits)
    for point in points:
        assert_near(cache[point], want[point], f"{what} {point}")


def test_a_last_position_capture_reads_the_cached_prefix_and_is_exact(models):
    model, eager = models
    capture(model, prompt(1, prefix=1), [])  # plain: fills the cache with the prefix
    tokens = prompt(2, prefix=1)
    cache, cached = capture(model, tokens, POINTS, positions=-1)
    assert cached == PREFIX, "the second request did not hit the prefix cache"
    check(cache, eager, tokens, POINTS, "after a cached prefix", positions=-1)


def test_a_capture_of_every_position_recomputes_the_cached_prefix(models):
    model, eager = models
    capture(model, prompt(1, prefix=2), [])
    tokens = prompt(3, prefix=2)
    assert capture(model, prompt(4, prefix=2), [], positions=-1)[1] == PREFIX  # the prefix is cached
    cache, cached = capture(model, tokens, POINTS)
    assert cached == 0
    check(cache, eager, tokens, POINTS, "every position")
    tail, cached = capture(model, tokens, POINTS, positions=[PREFIX + 1, -1])  # after the prefix: cache
    assert cached == PREFIX
    check(tail, eager, tokens, POINTS, "inside the last block", positions=[PREFIX + 1, -1])
    middle, cached = capture(model, tokens, POINTS, positions=[BLOCK + 3, -1])  # inside block 1
    assert cached == BLOCK
    check(middle, eager, tokens, POINTS, "inside a cached block", positions=[BLOCK + 3, -1])


def test_edits_read_the_prefix_before_them_and_never_share_what_they_wrote(models):
    model, eager = models
    vector = torch.randn(model.info.d_model, generator=torch.Generator().manual_seed(5))
    tokens = prompt(6, prefix=3)
    capture(model, prompt(7, prefix=3), [])
    last = {"resid_post.0": Add(vector, positions=-1)}
    cache, cached = capture(model, tokens, ["logits"], positions=-1, edits=last)
    assert cached == PREFIX
    check(cache, eager, tokens, ["logits"], "edited at the last position", positions=-1, edits=last)
    every = {"resid_post.0": Add(vector, scale=4.0)}  # edits every position, so every KV block
    cache, cached = capture(model, tokens, ["logits"], edits=every)
    assert cached == 0
    check(cache, eager, tokens, ["logits"], "edited everywhere", edits=every)
    # the same tokens again, unedited: the edited request's blocks are not found in the cache
    cache, cached = capture(model, tokens, ["logits"], positions=-1)
    assert cached == PREFIX
    check(cache, eager, tokens, ["logits"], "unedited after an edited run", positions=-1)


def test_a_prefill_that_runs_fewer_layers_shares_its_blocks_only_with_its_kind(models):
    model, eager = models
    tokens = prompt(8, prefix=4)
    short, cached = capture(model, prompt(9, prefix=4), ["resid_post.0"], positions=-1)
    assert cached == 0 and model._loop.shortened_steps
    short, cached = capture(model, tokens, ["resid_post.0"], positions=-1)
    assert cached == PREFIX  # from the first shortened prefill
    check(short, eager, tokens, ["resid_post.0"], "shortened after a shortened prefill", positions=-1)
    # its blocks hold no keys and values past layer 0: a whole-model request must not read them
    whole, cached = capture(model, tokens, ["logits"], positions=-1)
    assert cached == 0
    check(whole, eager, tokens, ["logits"], "whole model after shortened prefills", positions=-1)


def test_the_kv_guard_leaves_cached_blocks_alone(models):
    model, _ = models
    zeroed = run_on_loop(model._loop, "interp_state")[0]["kv_blocks_zeroed"]
    capture(model, prompt(10, prefix=5), [])
    first = run_on_loop(model._loop, "interp_state")[0]["kv_blocks_zeroed"] - zeroed
    assert capture(model, prompt(11, prefix=5), [])[1] == PREFIX
    second = run_on_loop(model._loop, "interp_state")[0]["kv_blocks_zeroed"] - zeroed - first
    assert first == 3 and second == 1  # two prefix blocks and a partial one; then the partial one only


def test_prompts_longer_than_a_step_are_captured_whole_across_chunks(models):
    model, eager = models
    g = torch.Generator().manual_seed(12)
    long = [torch.randint(3, 250, (1, n), generator=g) for n in (200, 130, 97)]
    assert all(t.shape[1] > BUDGET for t in long)
    for tokens, cache in zip(long, model.run_many(long, POINTS)):  # in flight together: chunks interleave
        check(cache, eager, tokens, POINTS, f"{tokens.shape[1]} tokens in chunks of {BUDGET}")
    edits = {"resid_mid.1": Add(torch.randn(model.info.d_model, generator=g), positions=[5, 60, 150])}
    cache, _ = capture(model, long[0], POINTS, edits=edits)
    check(cache, eager, long[0], POINTS, "edited across chunks", edits=edits)
    completion, cache = capture_generation(model, long[1], ["resid_post.1", "logits"], max_tokens=4,
                                           stop_at_eos=False)
    want_completion, want = capture_generation(eager, long[1], ["resid_post.1", "logits"], max_tokens=4,
                                               stop_at_eos=False)
    assert completion.token_ids == want_completion.token_ids
    for point in ("resid_post.1", "logits"):
        assert_near(cache[point], want[point], f"generation after a chunked prefill {point}")
