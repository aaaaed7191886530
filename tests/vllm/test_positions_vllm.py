"""positions=, whole sites, tokens and the logit lens on the vLLM backend (TP=1 and TP=2).

Oracles: the same engine's full capture indexed by hand (the same forward: bit for bit, except
``logits``, whose unembedding then runs on fewer rows), the eager backend on the same weights
(rel 1e-4), and the bytes each worker reports handing back (``probes.engine_state(model)[rank]["bytes_returned"]``):
a selection of k of n positions must hand back exactly k/n of the bytes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import capture_generation, lens_top, load_model, logit_lens, run_with_cache
from interp_engine.archs.vllm_reads import EAGER_ONLY

from .. import tiny
from ..oracles import assert_near
from ..probes import engine_state

pytest.importorskip("vllm")

POINTS = ["resid_post", "z.1", "mlp_out.2", "k.0", "logits"]
PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def pair(request, tiny_path):
    path = str(tiny_path(request.param))
    with load_model(path, backend="vllm", max_model_len=128) as model:
        yield model, load_model(path, backend="eager")


def returned(model) -> list[int]:
    return [rank["bytes_returned"] for rank in engine_state(model)]


def check_selected(got, full, rows: list[int], what: str) -> None:
    assert got.selected and got.positions.tolist() == [rows], what
    for address, tensor in full.items():
        want = tensor[:, rows]
        if address.name == "logits":
            assert_near(got[address], want, f"{what} {address}", rel=1e-5)
        else:
            assert torch.equal(got[address], want), f"{what} {address}"


def test_positions_equal_the_full_capture_and_shrink_the_bytes(pair):
    model, _ = pair
    tokens = model.to_tokens(PROMPT)
    n = tokens.shape[1]
    before = returned(model)
    full = run_with_cache(model, tokens, POINTS)
    full_bytes = returned(model)[0] - before[0]
    for positions, rows in [(-1, [n - 1]), ([0, -1], [0, n - 1]), (slice(-4, None), list(range(n - 4, n))),
                            ("prompt", list(range(n)))]:
        before = returned(model)[0]
        got = run_with_cache(model, tokens, POINTS, positions=positions)
        check_selected(got, full, rows, str(positions))
        # what the worker handed back is exactly the selected rows (and their positions)
        assert (returned(model)[0] - before) * n == full_bytes * len(rows), positions


def test_generation_positions(pair):
    model, _ = pair
    tokens = model.to_tokens("Once upon a time")
    n = tokens.shape[1]
    before = returned(model)[0]
    completion, full = capture_generation(model, tokens, ["resid_post.0", "z.1", "logits"], max_tokens=6)
    full_bytes = returned(model)[0] - before
    total = full.tokens.shape[1]
    for positions, rows in [("generated", list(range(n, total))), (-1, [n - 1]), ([1, -1], [1, n - 1])]:
        before = returned(model)[0]
        again, cache = capture_generation(model, tokens, ["resid_post.0", "z.1", "logits"], max_tokens=6,
                                          positions=positions)
        assert again.token_ids == completion.token_ids and torch.equal(cache.tokens, full.tokens)
        check_selected(cache, full, rows, f"generating, {positions}")
        assert (returned(model)[0] - before) * total == full_bytes * len(rows), positions


def test_async_captures_with_different_positions_share_a_forward(pair):
    model, _ = pair
    prompts = [model.to_tokens(t) for t in ("a", "bb cc", "ddd eee fff", "gggg")]
    specs = [-1, None, [0, 2], "prompt"]

    async def gather():
        return await asyncio.gather(*(model.capture(p, ["resid_post.1"], positions=s) for p, s in zip(prompts, specs)))

    n = [p.shape[1] for p in prompts]
    expected = [[n[0] - 1], list(range(n[1])), [0, 2], list(range(n[3]))]
    for p, spec, rows, got in zip(prompts, specs, expected, asyncio.run(gather())):
        full = run_with_cache(model, p, ["resid_post.1"])["resid_post.1"]
        (tensor,) = got.values()
        assert_near(tensor, full[:, rows], f"async {spec}", rel=1e-5)  # batched with others: not bitwise


def test_whole_sites_and_filters_expand_as_on_eager(pair):
    model, eager = pair
    # the points the vLLM backend refuses with a reason (issue 37: read around each block on eager only)
    eager_only = {"pattern", "attn_scores", *EAGER_ONLY}
    assert model.points() == [a for a in eager.points() if a.name not in eager_only]
    assert model.points("resid_post") == eager.points("resid_post")
    tokens = model.to_tokens("whole")
    only = lambda a: a.layer == 1 and a.name in ("attn_out", "z")  # noqa: E731
    got = run_with_cache(model, tokens, ["resid_post", only])
    want = run_with_cache(eager, tokens, ["resid_post", only])
    assert list(got) == list(want) == [*eager.points("resid_post"), *[a for a in eager.points() if only(a)]]
    for address in want:
        assert_near(got[address], want[address], str(address))
    assert model.to_str_tokens(PROMPT) == eager.to_str_tokens(PROMPT)
    assert model.to_string(tokens) == eager.to_string(tokens)


def test_logit_lens_equals_eager(pair):
    model, eager = pair
    assert_near(model.unembed_weight(), eager.unembed_weight().detach(), "W_U", rel=0)
    tokens = model.to_tokens(PROMPT)
    points = ["resid_post", "logits"]
    got, want = run_with_cache(model, tokens, points), run_with_cache(eager, tokens, points)
    # the lens computation itself, on the same residual stream: what eager computes
    with torch.no_grad():
        resid = want["resid_post.1"]
        assert_near(model.unembed(model.final_norm(resid)), eager.unembed(eager.final_norm(resid)), "lens op", rel=1e-6)
    lens = logit_lens(model, got)
    assert_near(lens, logit_lens(eager, want), "logit_lens", rel=1e-4)
    assert_near(lens[-1], got["logits"], "lens at the last layer == vLLM's logits", rel=1e-4)
    assert torch.equal(lens_top(model, got).ids[-1], got["logits"].argmax(-1))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = str(tiny.build("llama", tmp_path_factory.mktemp("tp_positions")))
    with load_model(path, backend="vllm", max_model_len=128, tensor_parallel_size=2) as model:
        yield model, load_model(path, backend="eager")


def test_tp2_positions_lens_and_bytes(tp2):
    model, eager = tp2
    tokens = model.to_tokens(PROMPT)
    n = tokens.shape[1]
    before = returned(model)
    full = run_with_cache(model, tokens, ["resid_post.2", "z.1", "k.0", "logits"])
    mid = returned(model)
    last = run_with_cache(model, tokens, ["resid_post.2", "z.1", "k.0", "logits"], positions=-1)
    after = returned(model)
    check_selected(last, full, [n - 1], "TP=2, -1")
    for rank in range(2):  # both ranks: rank 1 holds its shards of z and k only
        assert (mid[rank] - before[rank]) == n * (after[rank] - mid[rank]) > 0, rank
    completion, gen = capture_generation(model, tokens, ["z.1"], max_tokens=5)
    _, gen_sel = capture_generation(model, tokens, ["z.1"], max_tokens=5, positions="generated")
    assert torch.equal(gen_sel["z.1"], gen["z.1"][:, n:])
    # the unembedding's vocabulary shards are joined in rank order, vLLM's padding cut off
    assert torch.equal(model.unembed_weight(), eager.unembed_weight().detach())
    assert_near(logit_lens(model, full, [2]), logit_lens(eager, run_with_cache(eager, tokens, ["resid_post.2"])),
                "TP=2 lens")
