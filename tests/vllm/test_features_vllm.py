"""Feature points on the vLLM backend: encoded inside the worker from each request's own rows, only
the active features crossing back; the eager backend (itself checked against the maths and
hand-written HF hooks in test_features_eager.py) is the oracle on the same weights: values within
1e-4 relative, the same active features away from ties. One shared engine for the module."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import Set, Zero, build_dataset, capture_generation, run_with_cache
from interp_engine.errors import InputError

from .. import sparse_dicts as sd
from ..oracles import REL, assert_near
from ..probes import engine_state

pytest.importorskip("vllm")

PROMPT = "features, not just activations"
PROMPTS = ["the first prompt", "a second, longer prompt with more words", "third"]


@pytest.fixture(scope="module")
def models(tiny_path, eager_models):
    from interp_engine import load_model

    with load_model(str(tiny_path("llama")), backend="vllm", max_model_len=128) as vllm_model:
        yield vllm_model, eager_models("llama")


@pytest.fixture(scope="module")
def tokens(models):
    return models[1].to_tokens(PROMPT)


def assert_same_active(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The same active features, except where a feature sits at the boundary within the tolerance
    (a value near zero, or near the k-th largest for TopK): a tie the two backends may break apart."""
    differ = (got != 0) != (want != 0)
    if not differ.any():
        return
    scale = float(want.abs().max())
    kth = torch.where(want != 0, want, torch.full_like(want, float("inf"))).min(-1, keepdim=True).values
    near = (torch.minimum(got.abs(), want.abs()) <= REL * scale) | ((got - kth).abs() <= REL * scale)
    assert bool(near[differ].all()), f"{what}: active features differ away from ties"


def both(models, tokens, points, **kwargs):
    vllm_model, eager = models
    return run_with_cache(vllm_model, tokens, points, **kwargs), run_with_cache(eager, tokens, points, **kwargs)


@pytest.mark.parametrize("kind", ["relu", "jumprelu", "topk"])
def test_vllm_features_equal_eager(models, tokens, kind):
    sae = sd.sae(jumprelu=kind == "jumprelu", k=12 if kind == "topk" else None)
    points = ["resid_post.1.features", "resid_post.1.features[3,40]", "resid_post.1.sae_error", "resid_post.1"]
    got, want = both(models, tokens, points, saes=sae)
    for point in points:
        assert_near(got[point], want[point], point, REL)
    assert_same_active(got["resid_post.1.features"], want["resid_post.1.features"], kind)
    assert (got["resid_post.1.features"] != 0).sum() > 0


@pytest.mark.parametrize("skip", [False, True])
def test_vllm_transcoder_equals_eager(models, tokens, skip):
    tc = sd.transcoder(skip=skip)
    points = ["resid_mid.1.features", "mlp_out.1.sae_error", "logits"]
    got, want = both(models, tokens, points, saes=tc)
    for point in points:
        assert_near(got[point], want[point], point, REL)
    got, want = both(models, tokens, ["logits", "mlp_out.1"], saes=tc, edits={"mlp_out.1.sae_error": Zero()})
    assert_near(got["mlp_out.1"], want["mlp_out.1"], "spliced transcoder", REL)
    assert_near(got["logits"], want["logits"], "spliced logits", REL)


def test_vllm_feature_edits_equal_eager(models, tokens):
    sae = sd.sae(k=16)
    edits = {"resid_post.1.features[5,9]": Set(3.0, positions=[2, -1]), "resid_post.1.features[11]": Zero(),
             "resid_post.1.sae_error": Zero(positions=[4])}
    points = ["logits", "resid_post.1.features[5,9,11]", "resid_post.1.sae_error", "resid_post.2"]
    got, want = both(models, tokens, points, saes=sae, edits=edits)
    for point in points:
        assert_near(got[point], want[point], point, REL)
    assert (got["resid_post.1.features[5,9,11]"][0, [2, -1], :2] == 3.0).all()
    assert not got["resid_post.1.sae_error"][0, 4].any()


def test_vllm_generation_with_feature_edits_equals_eager(models, tokens):
    vllm_model, eager = models
    sae = sd.sae(k=16)
    kwargs = dict(max_tokens=6, saes=sae, edits={"resid_post.1.features[7]": Set(8.0)})
    comp_v, got = capture_generation(vllm_model, tokens, ["resid_post.1.features", "logits"], **kwargs)
    comp_e, want = capture_generation(eager, tokens, ["resid_post.1.features", "logits"], **kwargs)
    assert comp_v.token_ids == comp_e.token_ids
    assert_near(got["resid_post.1.features"], want["resid_post.1.features"], "generated features", REL)
    assert (got["resid_post.1.features"][..., 7] == 8.0).all()


def test_only_the_selected_positions_and_active_features_leave_the_worker(models, tokens):
    vllm_model, eager = models
    sae = sd.sae(k=12)
    n = tokens.shape[1]
    before = engine_state(vllm_model)[0]["bytes_returned"]
    got = run_with_cache(vllm_model, tokens, ["resid_post.1.features"], saes=sae, positions=[0, -1])
    sent = engine_state(vllm_model)[0]["bytes_returned"] - before
    assert got.positions.tolist() == [[0, n - 1]]
    want = run_with_cache(eager, tokens, ["resid_post.1.features"], saes=sae, positions=[0, -1])
    assert_near(got["resid_post.1.features"], want["resid_post.1.features"], "selected", REL)
    nnz = int((got["resid_post.1.features"] != 0).sum())
    # ids (int32) and values (float32) of the active ones, offsets and positions (int64) per kept row
    assert sent == nnz * 8 + 3 * 8 + 2 * 8
    before = engine_state(vllm_model)[0]["bytes_returned"]
    every = run_with_cache(vllm_model, tokens, ["resid_post.1.features"], saes=sae)["resid_post.1.features"]
    sent = engine_state(vllm_model)[0]["bytes_returned"] - before
    assert sent == int((every != 0).sum()) * 8 + (n + 1) * 8 + n * 8
    assert sent < n * sd.D_SAE * 4 / 10  # a tenth of the dense [n, d_sae] float32 rows
    assert engine_state(vllm_model)[0]["hooks"] == 0  # an idle engine runs unhooked


def test_concurrent_requests_get_their_own_dictionaries_and_edits(models, tokens):
    vllm_model, eager = models
    a, b = sd.sae(k=12), sd.sae(seed=4, jumprelu=True)
    rows = [eager.to_tokens(p) for p in PROMPTS]
    asks = [dict(points=["resid_post.1.features"], saes=a), dict(points=["resid_post.1.sae_error", "logits"], saes=b,
            edits={"resid_post.1.features[2]": Set(5.0)}), dict(points=["logits"])]

    async def run():
        return await asyncio.gather(*(vllm_model.capture(row, **ask) for row, ask in zip(rows, asks)))

    results = asyncio.run(run())
    for row, ask, got in zip(rows, asks, results):
        want = asyncio.run(eager.capture(row, **ask))
        assert list(got) == list(want)
        for point in want:
            assert_near(got[point], want[point], str(point), REL)
    assert len(vllm_model._dictionaries) >= 2  # each sent once, kept by key


def test_vllm_dataset_of_sparse_features_equals_eager(models, tmp_path):
    vllm_model, eager = models
    sae = sd.sae(k=12)
    kwargs = dict(layout="token", progress=False, saes=sae)
    got = build_dataset(vllm_model, PROMPTS, ["resid_post.1.features"], tmp_path / "v", **kwargs)
    want = build_dataset(eager, PROMPTS, ["resid_post.1.features"], tmp_path / "e", **kwargs)
    g, w = got.tensor("resid_post.1.features"), want.tensor("resid_post.1.features")
    assert_near(g, w, "dataset features", REL)
    assert_same_active(g, w, "dataset features")


def test_vllm_refuses_what_it_cannot_run(models, tokens):
    vllm_model, _ = models
    with pytest.raises(InputError, match="detach=False"):
        run_with_cache(vllm_model, tokens, ["resid_post.1.features"], saes=sd.sae(), detach=False)


def test_a_dashboard_on_vllm_equals_eager(models, tmp_path):
    """feature_dashboard on the vLLM backend (one request per prompt, features encoded in the
    worker): the same firing counts away from ties — a feature's counts differ by at most the
    number of tokens where it is at a tie (its pre-activation, from eager's ``resid_post.1`` and
    the encoder's weights, within the tolerance of the TopK cut when the cut is contested, or of
    zero) — and maxima within 1e-4."""
    from interp_engine import feature_dashboard

    vllm_model, eager = models
    prompts = PROMPTS + [PROMPT, "one more for the road"]
    sae = sd.sae(k=12)
    got = feature_dashboard(vllm_model, prompts, [sae], tmp_path / "v", top_k=3, shard_size=2).features().to_pandas()
    want = feature_dashboard(eager, prompts, [sae], tmp_path / "e", top_k=3, shard_size=2).features().to_pandas()
    assert len(got) == len(want) == sd.D_SAE and want["n_fired"].sum() > 0
    assert list(got["feature"]) == list(want["feature"]) == list(range(sd.D_SAE))
    ties = torch.zeros(sd.D_SAE, dtype=torch.long)
    for prompt in prompts:
        pre = sd.pre_by_hand(sae, run_with_cache(eager, eager.to_tokens(prompt), ["resid_post.1"])["resid_post.1"][0])
        band = 10 * REL * float(pre.abs().max())
        top = pre.topk(sae.k + 1, dim=-1).values
        cut, below = top[:, sae.k - 1:sae.k], top[:, sae.k:]
        contested = (cut - below <= 2 * band) & (((pre - cut).abs() <= band) | ((pre - below).abs() <= band))
        ties += (contested | ((pre.abs() <= band) & (pre >= below))).sum(0)
    differ = torch.tensor((got["n_fired"] - want["n_fired"]).abs().to_numpy())
    assert bool((differ <= ties).all()), f"firing counts differ away from ties: {differ[differ > ties]}"
    assert_near(torch.tensor(got["max_activation"].to_numpy()), torch.tensor(want["max_activation"].to_numpy()),
                "dashboard maxima", REL)


def test_dictionaries_a_replica_drops_leave_the_workers(models, tokens):
    """A service replica's bound (:class:`HeldDictionaries`) holds on the workers too: each
    dictionary it drops, the workers drop once no call uses it; one used again is sent again."""
    from interp_engine.service.held import HeldDictionaries, dictionary_bytes

    vllm_model, eager = models
    saes = [sd.sae(seed=100 + i) for i in range(5)]
    held = HeldDictionaries(2 * dictionary_bytes(saes[0]), on_drop=vllm_model.drop_dictionary)
    before = engine_state(vllm_model)[0]  # what the module's other tests left there

    def on_workers() -> tuple[int, int]:
        state = engine_state(vllm_model)[0]
        return state["dictionaries"] - before["dictionaries"], state["dictionary_bytes"] - before["dictionary_bytes"]

    def call(sae, point="resid_post.1.features"):  # as a replica's call: pinned while it runs
        held.pin([sae.key])
        try:
            return run_with_cache(vllm_model, tokens, [point], saes=held.get(sae.key) or held.keep(sae.key, sae))
        finally:
            held.unpin([sae.key])

    for sae in saes:
        call(sae)
        assert on_workers() == (held.stats()["held"], held.nbytes) and held.nbytes <= held.limit
    assert held.stats()["dropped"] == 3
    held.pin([saes[3].key])  # a call in flight keeps its dictionary on the workers past the bound
    call(saes[0])
    assert saes[3].key not in held.keys() and on_workers()[0] == 3
    held.unpin([saes[3].key])
    assert on_workers() == (2, held.nbytes)
    got = call(saes[1], "resid_post.1.features")  # dropped before: sent again
    want = run_with_cache(eager, tokens, ["resid_post.1.features"], saes=saes[1])
    assert_near(got["resid_post.1.features"], want["resid_post.1.features"], "a dictionary sent again", REL)
    assert on_workers() == (2, held.nbytes)
