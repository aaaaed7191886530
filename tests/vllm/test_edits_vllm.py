"""Edits on the vLLM backend: the eager backend (itself checked against hand-written HF hooks in
test_edits.py) is the oracle, on the same weights; one shared engine for the module."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import (Ablate, Add, Address, AddressError, Cap, InputError, Rotate, Scale, Set, Swap, Zero,
                           capture_generation, parse_address, run_with_cache)

from ..contract import assert_contract
from ..oracles import REL, REL_SAME, assert_near
from ..probes import engine_state

pytest.importorskip("vllm")

LAYER = 1
SITES = ["resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post", "resid_post", "z", "mlp_post",
         "q", "k", "v"]
PROMPT = "steer this prompt"


@pytest.fixture(scope="module")
def models(tiny_path, eager_models):
    from interp_engine import load_model

    with load_model(str(tiny_path("llama")), backend="vllm", max_model_len=128) as vllm_model:
        yield vllm_model, eager_models("llama")


def test_a_vllm_model_implements_the_contract(models):
    assert_contract(models[0], writes_shards=False)


def _block(model, site):
    info = model.info
    return {"z": (info.n_heads, info.d_head), "q": (info.n_heads, info.d_head),
            "k": (info.n_kv_heads, info.d_head), "v": (info.n_kv_heads, info.d_head),
            "mlp_post": (info.d_mlp,)}.get(site, (info.d_model,))


def _edits(model, site):
    g = torch.Generator().manual_seed(7)
    block = _block(model, site)
    per_head = site in ("z", "q", "k", "v")
    return {
        "add": Add(torch.randn(block, generator=g), scale=2.0, positions=[1, -1]),
        "scale": Scale(0.25),
        "set": Set(torch.randn(block, generator=g), positions=[2]),
        "zero": Zero(heads=[1]) if per_head else Zero(positions=-2),
        "norm": Add(torch.randn(block[-1:], generator=g), scale=2.0, norm_relative=True),
        # directional edits: a direction per head on the per-head sites, one [d] vector elsewhere
        "ablate": Ablate(torch.randn(block, generator=g)),
        "cap": Cap(torch.randn(block[-1:], generator=g), max=1e-3, min=-1e-3, positions=[0, 1, -1]),
        "swap": Swap(torch.randn(block[-1:], generator=g), projection=3.0, positions=[1, -1]),
        "rotate": Rotate(torch.randn(block[-1:], generator=g), angle=0.5, heads=[0, 1] if per_head else None),
    }


@pytest.mark.parametrize("site", SITES)
def test_prefill_edits_equal_eager(models, site):
    vllm_model, eager = models
    tokens = eager.to_tokens(PROMPT)
    address = f"{site}.{LAYER}"
    points = ["logits", address, f"resid_post.{eager.n_layers - 1}"]
    plain = run_with_cache(eager, tokens, ["logits"])["logits"]
    for kind, edit in _edits(eager, site).items():
        want = run_with_cache(eager, tokens, points, edits={address: edit})
        got = run_with_cache(vllm_model, tokens, points, edits={address: edit})
        assert (want["logits"] - plain).abs().max() > 1e-4, f"{address} {kind} changed nothing"
        for point in points:
            assert_near(got[point], want[point], f"{address} {kind}: {point}", REL)


def test_greedy_generation_with_a_steering_vector_equals_eager(models):
    vllm_model, eager = models
    tokens = eager.to_tokens(PROMPT)
    vector = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(0))
    steer = {f"resid_post.{LAYER}": Add(vector, scale=20.0)}
    plain, _ = capture_generation(vllm_model, tokens, ["logits"], max_tokens=8)
    want, want_cache = capture_generation(eager, tokens, ["logits", "z.2"], max_tokens=8, edits=steer)
    got, got_cache = capture_generation(vllm_model, tokens, ["logits", "z.2"], max_tokens=8, edits=steer)
    assert want.token_ids != plain.token_ids  # the vector changes what is generated
    assert got.token_ids == want.token_ids
    for point in ("logits", "z.2"):
        assert_near(got_cache[point], want_cache[point], f"steered generation {point}", REL)
    # edits of the generated positions only, and of a per-head site during decoding
    head = torch.randn(eager.info.d_head, generator=torch.Generator().manual_seed(1))
    for edits in ({f"resid_post.{LAYER}": Add(vector, scale=20.0, positions="generated")},
                  {f"z.{LAYER}": Zero(heads=[0, 3]), "v.0": Scale(3.0, positions=[0, -1])},
                  {f"resid_post.{LAYER}": [Rotate(vector, angle=1.2), Cap(vector, min=-0.5, max=0.5)],
                   "z.0": Ablate(head, heads=[1]), "k.2": Swap(head, projection=4.0, positions="generated")}):
        want, want_cache = capture_generation(eager, tokens, ["logits"], max_tokens=6, edits=edits)
        got, got_cache = capture_generation(vllm_model, tokens, ["logits"], max_tokens=6, edits=edits)
        assert got.token_ids == want.token_ids
        assert_near(got_cache["logits"], want_cache["logits"], f"{list(edits)} generation", REL)


def test_concurrent_requests_never_share_edits(models):
    """32 requests in flight on one engine, half of them with edits (four share one edit, the
    others each their own): every one equals the same request made alone; the edits are large,
    so a leak would show by far."""
    vllm_model, eager = models
    prompts = [eager.to_tokens(f"request {i} " + "x" * (i % 5)) for i in range(32)]
    g = torch.Generator().manual_seed(1)
    sites = ["resid_post", "resid_pre", "resid_mid", "attn_out", "mlp_out", "z", "mlp_post", "v"]
    shared = {"resid_post.0": Add(torch.randn(eager.d_model, generator=g), scale=5.0)}  # one entry, many rows
    edits = []
    for i in range(32):
        if i % 2:
            edits.append(None)
            continue
        if i % 8 == 2:
            edits.append(shared)
            continue
        site = sites[(i // 2) % len(sites)]
        edit = Add(torch.randn(_block(eager, site), generator=g), scale=5.0,
                   positions=None if i % 4 == 0 else [-1, 1])
        edits.append({f"{site}.{(i // 2) % eager.n_layers}": edit})
    points = ["logits", f"resid_post.{eager.n_layers - 1}"]

    async def all_at_once():
        return await asyncio.gather(*(vllm_model.capture(p, points, edits=e, max_tokens=3)
                                      for p, e in zip(prompts, edits)))

    together = asyncio.run(all_at_once())
    assert max(rank["max_batch"] for rank in engine_state(vllm_model)) > 1  # they shared forwards
    for i, (tokens, edit, got) in enumerate(zip(prompts, edits, together)):
        alone = asyncio.run(vllm_model.capture(tokens, points, edits=edit, max_tokens=3))
        for point in points:
            a = parse_address(point)
            assert_near(got[a], alone[a], f"request {i} ({'edited' if edit else 'plain'}) {point}", REL_SAME)
        if edit:
            plain = asyncio.run(vllm_model.capture(tokens, points, max_tokens=3))
            key = Address("logits")
            assert (plain[key] - alone[key]).abs().max() > 1e-2, f"request {i}: the edit changed nothing"
    for rank in engine_state(vllm_model):
        assert rank["pending"] == [] and rank["hooks"] == 0 and rank["edited"] == []


@pytest.mark.parametrize("edits, error, words", [
    ({"resid_post.1": lambda t, a: t}, InputError, "eager backend only"),
    ({"pattern.1": Zero()}, AddressError, "vLLM never forms the attention pattern"),
    ({"resid_streams.1.0": Zero()}, AddressError, "cannot be edited on the vllm backend"),
    ({"resid_post.1": Add(torch.zeros(3))}, InputError, "[128]"),
    ({"z.1": Zero(heads=[9])}, InputError, "valid: 0..3"),
    ({"resid_post.1": Zero(positions=[99])}, InputError, "out of range"),
])
def test_bad_edits_on_vllm_are_clear_errors(models, edits, error, words):
    vllm_model, eager = models
    tokens = eager.to_tokens(PROMPT)
    before = run_with_cache(vllm_model, tokens, ["logits"])
    with pytest.raises(error, match=__import__("re").escape(words)):
        run_with_cache(vllm_model, tokens, ["logits"], edits=edits)
    after = run_with_cache(vllm_model, tokens, ["logits"])
    assert torch.equal(after["logits"], before["logits"])


@pytest.fixture(scope="module")
def gemma2(tiny_path, eager_models, models):
    """Gemma 2 (block outputs normed before the add; embeddings scaled): the same edits through
    its own site table. Started after the Llama engine's tests (``models`` first)."""
    from interp_engine import load_model

    with load_model(str(tiny_path("gemma2")), backend="vllm", max_model_len=128) as vllm_model:
        yield vllm_model, eager_models("gemma2")


@pytest.mark.parametrize("site", SITES)
def test_gemma2_edits_equal_eager(gemma2, site):
    vllm_model, eager = gemma2
    tokens = eager.to_tokens(PROMPT)
    address = f"{site}.{LAYER}"
    points = ["logits", address, f"resid_post.{eager.n_layers - 1}"]
    plain = run_with_cache(vllm_model, tokens, ["logits"])["logits"]
    for kind in ("add", "zero"):
        edit = _edits(eager, site)[kind]
        want = run_with_cache(eager, tokens, points, edits={address: edit})
        got = run_with_cache(vllm_model, tokens, points, edits={address: edit})
        assert (got["logits"] - plain).abs().max() > 1e-4, f"gemma2 {address} {kind} changed nothing"
        for point in points:
            assert_near(got[point], want[point], f"gemma2 {address} {kind}: {point}", REL)


def test_edits_reach_the_worker_as_tensors(models, monkeypatch):
    """An edit's vector travels to the vLLM worker as a tensor (vLLM's collective_rpc carries it
    as a buffer), never as a Python list; the worker refuses a list as an internal error."""
    from interp_engine import Add, Set, run_with_cache
    from interp_engine.backends.vllm.worker import edits as vllm_edits
    from interp_engine.wire import edit_from_worker

    vllm_model, _ = models
    seen = []
    register = vllm_edits.EditBook.register

    def spy(self, rid, edits):
        seen.extend(data for chain in edits.values() for data in chain)
        return register(self, rid, edits)

    monkeypatch.setattr(vllm_edits.EditBook, "register", spy)
    tokens = vllm_model.to_tokens(PROMPT)
    vector = torch.ones(vllm_model.d_model)
    run_with_cache(vllm_model, tokens, ["resid_post.1"],
                   edits={"resid_post.0": Add(vector), "mlp_out.1": Set(torch.zeros(vllm_model.d_model))})
    assert len(seen) == 2
    for data in seen:
        payload = data.get("vector", data.get("value"))
        assert isinstance(payload, torch.Tensor), f"an edit reached the worker as {type(payload).__name__}"
    with pytest.raises(RuntimeError, match=r"\[Internal\].*as list, not a tensor"):
        edit_from_worker({**seen[0], "vector": seen[0]["vector"].tolist()} if "vector" in seen[0]
                  else {**seen[0], "value": seen[0]["value"].tolist()})


def test_logprobs_equal_the_captured_logits_and_eager(models):
    """A steered generation's logprobs (each sampled token's, and the top 3 per step) equal
    log_softmax of the logits vLLM's own capture holds at each step, and eager's logprobs."""
    vllm_model, eager = models
    tokens = eager.to_tokens(PROMPT)
    steer = {f"resid_post.{LAYER}": Ablate(torch.randn(eager.d_model, generator=torch.Generator().manual_seed(5)))}
    got, cache = capture_generation(vllm_model, tokens, ["logits"], max_tokens=6, top_logprobs=3, edits=steer)
    want, _ = capture_generation(eager, tokens, ["logits"], max_tokens=6, top_logprobs=3, edits=steer)
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.top_logprobs) == 6
    steps = torch.log_softmax(cache["logits"][0, tokens.shape[1] - 1:].double(), dim=-1)
    assert got.logprobs == pytest.approx([float(steps[i, t]) for i, t in enumerate(got.token_ids)], abs=1e-4)
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    for step, (a, b) in enumerate(zip(got.top_logprobs, want.top_logprobs)):
        assert list(a) == list(b) == steps[step].topk(3).indices.tolist(), f"step {step}"
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


def test_stream_is_refused_with_the_fix(models):
    """Streaming runs on a local eager model so far: vLLM refuses it naming the call that works."""
    vllm_model, eager = models

    async def first():
        async for step in vllm_model.stream(eager.to_tokens(PROMPT), ["logits"], max_tokens=2):
            return step

    with pytest.raises(InputError, match="capture_generation_async"):
        asyncio.run(first())
