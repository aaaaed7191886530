"""Issue 26 on the vLLM backend, all against one shared engine: TransformerLens names and negative
layers as addresses, layers as an int in the lens, lists of edits, batched activation patching,
the final_norm site, the TL-style attributes and a compact repr. The oracle is the eager backend
on the same weights (itself checked against hand-written hooks in tests/core/test_edits_compose.py
and tests/core/test_tl_names.py), within the cross-backend tolerance."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch

from interp_engine import (Add, Address, Scale, Set, Zero, capture_generation, lens_top, logit_lens, parse_address,
                           run_with_cache)

from ..oracles import REL, assert_near

pytest.importorskip("vllm")

PROMPT = "a prompt for the tl checks"


#: what vLLM logged while the module's engine started (it should be quiet: errors only)
STARTUP_LINES: list = []


@pytest.fixture(scope="module")
def models(tiny_path, eager_models):
    from interp_engine import load_model
    from interp_engine.backends.vllm import model  # noqa: F401  (vLLM's import-time lines come before any engine)

    handler = logging.Handler()
    handler.emit = STARTUP_LINES.append
    logging.getLogger("vllm").addHandler(handler)
    try:
        vllm_model = load_model(str(tiny_path("llama")), backend="vllm", max_model_len=128)
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    with vllm_model:
        yield vllm_model, eager_models("llama")


def test_the_engine_started_quietly(models):
    if os.environ.get("VLLM_LOGGING_LEVEL"):
        pytest.skip("VLLM_LOGGING_LEVEL is set: the user's level wins")
    lines = [f"{r.levelname} {r.getMessage()}" for r in STARTUP_LINES if r.levelno < logging.ERROR]
    assert not lines, f"vLLM printed {len(lines)} lines at start-up, e.g. {lines[:3]}"


@pytest.fixture(scope="module")
def tokens(models):
    return models[1].to_tokens(PROMPT)


def test_tl_names_and_negative_layers(models, tokens):
    vllm_model, eager = models
    n = eager.n_layers
    points = ["blocks.-1.hook_resid_post", "blocks.0.attn.hook_z", "resid_pre.-2", ("mlp_post", -1)]
    got = run_with_cache(vllm_model, tokens, points)
    want = run_with_cache(eager, tokens, points)
    real = [Address("resid_post", n - 1), Address("z", 0), Address("resid_pre", n - 2), Address("mlp_post", n - 1)]
    assert list(got) == real
    for address in real:
        assert_near(got[address], want[address], str(address), REL)
    assert got["resid_post", -1] is got[real[0]] is got[f"blocks.{n - 1}.hook_resid_post"]
    vector = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(4))
    edits = {"blocks.-2.hook_resid_post": Add(vector, scale=5.0)}
    got = run_with_cache(vllm_model, tokens, ["logits"], edits=edits)
    want = run_with_cache(eager, tokens, ["logits"], edits={f"resid_post.{n - 2}": Add(vector, scale=5.0)})
    plain = run_with_cache(eager, tokens, ["logits"])
    assert (want["logits"] - plain["logits"]).abs().max() > 1e-3
    assert_near(got["logits"], want["logits"], "edit at a negative layer", REL)


def test_the_lens_with_negative_and_int_layers(models, tokens):
    vllm_model, eager = models
    got = run_with_cache(vllm_model, tokens, ["resid_post"])
    want = run_with_cache(eager, tokens, ["resid_post"])
    assert_near(logit_lens(vllm_model, got, -1), logit_lens(eager, want, [eager.n_layers - 1]), "lens -1", REL)
    assert lens_top(vllm_model, got, [-1, 0]).layers == [eager.n_layers - 1, 0]


def test_lists_of_edits_equal_eager(models, tokens):
    vllm_model, eager = models
    g = torch.Generator().manual_seed(6)
    vector = torch.randn(eager.d_model, generator=g)
    cases = {
        "resid_post.1": [Add(vector, scale=3.0), Zero(positions=[0]), Scale(0.5, positions=[-1])],
        "resid_mid.0": [Scale(2.0), Add(vector, positions=[1, 2])],  # written through attn_out
        "z.1": [Scale(3.0, heads=[0, 1]), Set(torch.randn(eager.d_head, generator=g), heads=[0], positions=[-1])],
        "k.0": [Scale(0.5), Set(torch.randn(eager.d_head, generator=g), heads=[0], positions=[1])],
    }
    plain = run_with_cache(eager, tokens, ["logits"])["logits"]
    for address, chain in cases.items():
        points = ["logits", address if address != "resid_mid.0" else "attn_out.0"]
        got = run_with_cache(vllm_model, tokens, points, edits={address: chain})
        want = run_with_cache(eager, tokens, points, edits={address: chain})
        assert (want["logits"] - plain).abs().max() > 1e-4, address
        reversed_ = run_with_cache(eager, tokens, ["logits"], edits={address: chain[::-1]})["logits"]
        assert (reversed_ - want["logits"]).abs().max() > 1e-5, f"{address}: the order made no difference"
        for point in points:
            assert_near(got[point], want[point], f"{address}: {point}", REL)


def test_lists_in_generation_and_beside_other_requests(models, tokens):
    """A steering list during generation equals eager; requests in the same continuous batch
    with other lists (or none) each get their own."""
    vllm_model, eager = models
    vector = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(8))
    steer = {"resid_post.1": [Add(vector, scale=20.0), Scale(0.8, positions="generated")]}
    want, _ = capture_generation(eager, tokens, ["logits"], max_tokens=6, edits=steer)
    got, _ = capture_generation(vllm_model, tokens, ["logits"], max_tokens=6, edits=steer)
    assert got.token_ids == want.token_ids

    other = {"resid_post.1": [Scale(0.5), Add(vector)]}
    mine = {"resid_post.1": [Add(vector, scale=20.0), Scale(0.8, positions=[-1])]}

    async def together():
        return await asyncio.gather(vllm_model.capture(tokens, ["logits"], edits=mine),
                                    vllm_model.capture(tokens, ["logits"], edits=other),
                                    vllm_model.capture(tokens, ["logits"]))

    results = asyncio.run(together())
    for result, edits in zip(results, [mine, other, None]):
        want = run_with_cache(eager, tokens, ["logits"], edits=edits)["logits"]
        assert_near(result[parse_address("logits")], want, f"beside others: {edits}", REL)


def test_final_norm_cfg_tokenizer_repr_and_short_errors(models, tokens):
    vllm_model, eager = models
    got = run_with_cache(vllm_model, tokens, ["ln_final.hook_out", "logits", "resid_post.0"])
    want = run_with_cache(eager, tokens, ["final_norm", "logits"])
    assert_near(got["final_norm"], want["final_norm"], "final_norm", REL)
    assert_near(vllm_model.unembed(got["final_norm"]), got["logits"], "unembed(final_norm) = logits", REL)
    alone = run_with_cache(vllm_model, tokens, ["final_norm"], positions=[-1])
    assert_near(alone["final_norm"], want["final_norm"][:, -1:], "final_norm alone, last position", REL)
    fields = lambda cfg: {k: v for k, v in cfg.to_dict().items() if k != "device"}  # noqa: E731
    assert fields(vllm_model.cfg) == fields(eager.cfg) and vllm_model.d_vocab == eager.d_vocab
    assert vllm_model.tokenizer("a b")["input_ids"] == eager.tokenizer("a b")["input_ids"]
    name = eager.name.rstrip("/").rsplit("/", 1)[-1]
    assert repr(vllm_model) == (f"VllmModel({name!r}, {eager.n_layers} layers, float32, tensor_parallel_size=1, "
                                f"max_model_len=128)")
    big = torch.arange(eager.d_model * 4.0) + 1000
    with pytest.raises(ValueError) as info:
        run_with_cache(vllm_model, tokens, ["logits"], edits={"resid_post.1": Scale(big)})
    assert "Tensor[512] float32" in str(info.value) and len(str(info.value)) < 600


def test_batched_patching_values_on_one_request_equal_eager(models, tokens):
    """A request carries its own row's values: one per row ([1, d]), one per edited position
    ([1, n, d]), a whole [1, pos, d] Set (refused on vLLM before); requests in one continuous
    batch with different per-position values each get theirs."""
    vllm_model, eager = models
    g = torch.Generator().manual_seed(21)
    n = tokens.shape[1]
    cases = {
        "resid_post.1": Set(torch.randn(1, eager.d_model, generator=g), positions=[1]),
        "resid_pre.1": Set(torch.randn(1, 2, eager.d_model, generator=g), positions=[0, -1]),
        "mlp_out.0": Add(torch.randn(1, n, eager.d_model, generator=g)),
        "z.1": Set(torch.randn(1, 2, 1, eager.d_head, generator=g), heads=[2], positions=[1, 3]),
        "v.0": Set(torch.randn(1, n, eager.info.n_kv_heads, eager.d_head, generator=g)),
    }
    plain = run_with_cache(eager, tokens, ["logits"])["logits"]
    for address, edit in cases.items():
        want = run_with_cache(eager, tokens, ["logits"], edits={address: edit})["logits"]
        got = run_with_cache(vllm_model, tokens, ["logits"], edits={address: edit})["logits"]
        assert (want - plain).abs().max() > 1e-4, address
        assert_near(got, want, f"per-row {address}", REL)

    values = [torch.randn(1, 2, eager.d_model, generator=g) for _ in range(3)]
    edits = [{"resid_post.0": Set(v, positions=[1, 2])} for v in values]

    async def together():
        return await asyncio.gather(*(vllm_model.capture(tokens, ["logits"], edits=e) for e in edits))

    for result, e in zip(asyncio.run(together()), edits):
        want = run_with_cache(eager, tokens, ["logits"], edits=e)["logits"]
        assert_near(result[parse_address("logits")], want, "per-position values beside others", REL)


def test_a_padded_batch_with_per_row_values_is_split_with_its_rows(models):
    """What a replica (or a service replica) does with a batch on a one-prompt engine: each row
    at its own length, with its own row's values (batching.run_padded)."""
    from interp_engine.batching import run_padded

    vllm_model, eager = models
    tokens = eager.to_tokens(["a short one", "and a longer second prompt here"])
    g = torch.Generator().manual_seed(23)
    edits = {"resid_pre.1": [Scale(0.5), Set(torch.randn(2, 1, eager.d_model, generator=g), positions=[-1])],
             "mlp_out.0": Add(torch.randn(2, tokens.shape[1], eager.d_model, generator=g))}
    got = run_padded(vllm_model, tokens, [Address("logits"), Address("resid_post", 1)], edits=edits)
    want = run_with_cache(eager, tokens, ["logits", "resid_post.1"], edits=edits)
    for point in ("logits", "resid_post.1"):
        assert_near(got[point], want[point], f"run_padded {point}", REL)
