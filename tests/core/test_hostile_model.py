"""Hostile use of the model side (issue 27; cancellation is in test_cancel.py): analysis
helpers given a cache that lacks what they need (or arguments out of range), caches loaded from
inconsistent or damaged files, and a tuple given as ``points``.

Each refusal is a project error (an ``InputError`` subclass) whose message names what is wrong
and how to fix it; after each, the model returns exactly (``torch.equal``: the same computation)
what it returned before.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from interp_engine import (Address, AddressError, AnalysisError, Cache, CacheFileError, InputError, MissingActivations,
                           accumulated_resid, capture_generation, decompose_resid, head_contributions, lens_top,
                           logit_attribution, logit_lens, run_with_cache)

from ..oracles import assert_same

POINTS = ["resid_post.1", "z.2", "logits"]


@pytest.fixture(scope="module")
def llama(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def full_cache(llama):
    """Everything the helpers read, for a padded batch of two prompts."""
    tokens = llama.to_tokens(["The quick brown fox", "jumps"])
    return run_with_cache(llama, tokens, ["resid_pre", "resid_post", "attn_out_post", "mlp_out_post", "z", "logits"])


@pytest.fixture(scope="module")
def posts_cache(llama, full_cache):
    """The issue's cache: the embedding and every resid_post, no attn_out / mlp_out."""
    return run_with_cache(llama, full_cache.tokens, ["resid_pre.0", "resid_post"])


@pytest.fixture(scope="module")
def other_cache(eager_models, full_cache):
    """A cache of another model (Phi-3: d_model 256, the Llama's is 128), same tokens."""
    return run_with_cache(eager_models("phi3"), full_cache.tokens,
                          ["resid_pre", "resid_post", "attn_out_post", "mlp_out_post"])


@pytest.fixture
def unchanged(llama, full_cache):
    """After the test, the model returns exactly the cache it returned before it."""
    points = list(full_cache)
    yield
    again = run_with_cache(llama, full_cache.tokens, points)
    assert_same(again.to_dict(), full_cache.to_dict())


ANALYSIS_CASES = {
    # name: (call(model, caches), error type, message fragment)
    "decompose without attn_out/mlp_out": (
        lambda m, c: decompose_resid(c["posts"]), MissingActivations,
        r"decompose_resid \(layer=3\) needs attn_out_post.0, mlp_out_post.0, attn_out_post.1, mlp_out_post.1, "
        r"attn_out_post.2, mlp_out_post.2, "
        r"which this cache does not hold.*capture them"),
    "decompose with model= without attn_out/mlp_out": (
        lambda m, c: decompose_resid(c["posts"], model=m), MissingActivations, r"needs attn_out_post.0, mlp_out_post.0"),
    "attribution without attn_out/mlp_out": (
        lambda m, c: logit_attribution(m, c["posts"], 7), MissingActivations, r"needs attn_out_post.0"),
    "attribution without the final resid_post": (
        lambda m, c: logit_attribution(
            m, run_with_cache(m, c["full"].tokens, ["resid_pre.0", "attn_out_post", "mlp_out_post"]), 7),
        MissingActivations, r"needs resid_post.2.*final residual stream"),
    "decompose past the first layer from the end": (
        lambda m, c: decompose_resid(c["full"], layer=-5), AnalysisError,
        r"layer=-5 is out of range: layers are 0\.\.3 \(3 = the final resid_post; -1 = 3, -4 = 0\)"),
    "decompose past the last layer": (
        lambda m, c: decompose_resid(c["full"], layer=100), AnalysisError,
        r"layer=100 is out of range: layers are 0\.\.3 \(3 = the final resid_post;"),
    "decompose at a bool layer": (
        lambda m, c: decompose_resid(c["full"], layer=True), AnalysisError, r"layer must be an int.*got True \(bool\)"),
    "accumulated at a bool layer": (
        lambda m, c: accumulated_resid(c["full"], layer=True), AnalysisError, r"layer must be an int.*got True"),
    "accumulated before the first layer from the end": (
        lambda m, c: accumulated_resid(c["full"], layer=-5), AnalysisError, r"layer=-5 is out of range.*-4 = 0"),
    "accumulated past the end": (
        lambda m, c: accumulated_resid(c["full"], layer=4, model=m), AnalysisError,
        r"layer=4 is out of range: layers are 0\.\.3.*has 3 layers"),
    "accumulated without resid_pre": (
        lambda m, c: accumulated_resid(run_with_cache(m, c["full"].tokens, ["attn_out"]), model=m), MissingActivations,
        r"accumulated_resid needs resid_pre.0, resid_pre.1, resid_pre.2, resid_post.2"),
    "attribution to token -1": (
        lambda m, c: logit_attribution(m, c["full"], -1), AnalysisError,
        r"token id -1 is negative.*ids are 0\.\.319"),
    "attribution to a token past the vocabulary": (
        lambda m, c: logit_attribution(m, c["full"], 10**6), AnalysisError,
        r"token id 1000000 is outside the vocabulary of 320 tokens \(ids 0\.\.319\)"),
    "attribution to True": (
        lambda m, c: logit_attribution(m, c["full"], True), AnalysisError, r"True is a bool, not a token id"),
    "attribution to bool ids": (
        lambda m, c: logit_attribution(m, c["full"], torch.ones(2, 1, dtype=torch.bool)), AnalysisError,
        r"is a bool, not a token id"),
    "attribution to complex directions": (
        lambda m, c: logit_attribution(m, c["full"], torch.ones(128, dtype=torch.complex64)), AnalysisError,
        r"token ids must be ints and directions real floats"),
    "attribution to ids of the wrong shape": (
        lambda m, c: logit_attribution(m, c["full"], torch.zeros(5, 7, dtype=torch.long)), AnalysisError,
        r"tokens_or_directions \(read as directions\) has shape \(5, 7, 128\), which does not fit the cache's \(2, \d+, 128\)"),
    "attribution to a direction of another width": (
        lambda m, c: logit_attribution(m, c["full"], torch.randn(256)), AnalysisError,
        r"the direction given is 256 wide, but .* has d_model=128"),
    "attribution on another model's cache": (
        lambda m, c: logit_attribution(m, c["other"], 7), AnalysisError,
        r"resid_post.2 in this cache is 256 wide, but .* has d_model=128: it comes from another model"),
    "attribution with components of another width": (
        lambda m, c: logit_attribution(m, c["full"], 7, components=c["other"].get("attn_out_post", 0)[None]), AnalysisError,
        r"components is 256 wide"),
    "lens over no layers": (
        lambda m, c: logit_lens(m, c["full"], layers=[]), AnalysisError,
        r"layers=\[\] names no layer; pass None for every layer the cache holds"),
    "lens top over no layers": (
        lambda m, c: lens_top(m, c["full"], layers=[]), AnalysisError, r"layers=\[\] names no layer"),
    "lens with an address for layers": (
        lambda m, c: logit_lens(m, c["full"], layers="resid_post.2"), AnalysisError,
        r"layers takes layer numbers, got the string 'resid_post.2'.*cache\['resid_post.2'\]"),
    "lens before the first layer from the end": (
        lambda m, c: logit_lens(m, c["full"], layers=[-4]), AnalysisError, r"layer=-4 is out of range.*-3 = 0"),
    "lens past the last layer": (
        lambda m, c: logit_lens(m, c["full"], layers=[3]), AnalysisError,
        r"layer=3 is out of range: layers are 0\.\.2"),
    "lens at a bool layer": (
        lambda m, c: logit_lens(m, c["full"], layers=[True]), AnalysisError, r"layer must be an int"),
    "lens on another model's cache": (
        lambda m, c: logit_lens(m, c["other"]), AnalysisError, r"resid_post.0 in this cache is 256 wide"),
    "accumulated with apply_ln on another model's cache": (
        lambda m, c: accumulated_resid(c["other"], apply_ln=True, model=m), AnalysisError, r"is 256 wide"),
    "head contributions past the last layer": (
        lambda m, c: head_contributions(m, c["full"], 3), AnalysisError, r"layer=3 is out of range: layers are 0\.\.2"),
    "head contributions before the first layer from the end": (
        lambda m, c: head_contributions(m, c["full"], -4), AnalysisError, r"layer=-4 is out of range"),
    "head contributions without z": (
        lambda m, c: head_contributions(m, c["posts"], 1), MissingActivations, r"needs z.1.*capture it"),
}


@pytest.mark.parametrize("case", list(ANALYSIS_CASES))
def test_analysis_refuses(case, llama, full_cache, posts_cache, other_cache, unchanged):
    call, error, message = ANALYSIS_CASES[case]
    with pytest.raises(error, match=message):
        call(llama, {"full": full_cache, "posts": posts_cache, "other": other_cache})


def test_missing_activations_is_a_key_error_and_an_input_error(llama, posts_cache):
    with pytest.raises(KeyError) as info:
        decompose_resid(posts_cache)
    assert isinstance(info.value, InputError) and str(info.value).startswith("decompose_resid")


def test_the_helpers_still_answer_on_what_they_can_use(llama, full_cache, unchanged):
    """The checks refuse only what is wrong: the default decomposition of the full cache still sums
    to the final resid_post, an id list per position and a direction still work."""
    parts = decompose_resid(full_cache, model=llama)
    assert parts.shape[0] == 1 + 2 * llama.n_layers
    assert torch.allclose(parts.sum(0), full_cache.get("resid_post", llama.n_layers - 1), atol=1e-4)
    ids = torch.tensor([[5, 6], [7, 8]]).repeat(1, full_cache.tokens.shape[1] // 2 + 1)[:, : full_cache.tokens.shape[1]]
    assert logit_attribution(llama, full_cache, ids).shape == (parts.shape[0], *ids.shape)
    direction = llama.unembed_weight()[7].detach()
    assert torch.equal(logit_attribution(llama, full_cache, direction), logit_attribution(llama, full_cache, 7))
    assert logit_lens(llama, full_cache, layers=(0, 2)).shape[0] == 2


# -- Cache.load of damaged, hostile and inconsistent files ----------------------------------------

def _write(path, tensors: dict, order=None, raw_order: str | None = None):
    from safetensors.torch import save_file

    meta = {"format": "interp_engine.cache/1", "model_name": "m", "backend": "eager",
            "order": json.dumps([k for k in tensors if not k.startswith("__")] if order is None else order)}
    if raw_order is not None:
        meta["order"] = raw_order
    save_file(tensors, str(path), metadata=meta)
    return path


def _valid():
    return {"__tokens__": torch.tensor([[5, 6, 7]]), "__mask__": torch.ones(1, 3, dtype=torch.bool),
            "resid_post.1": torch.randn(1, 3, 8)}


CACHE_FILES = {
    # name: (write(path) -> path, message fragment)
    "the issue's shapes": (
        lambda p: _write(p, {"__tokens__": torch.tensor([[5, 6, 7]]), "__mask__": torch.ones(1, 7, dtype=torch.bool),
                             "resid_post.1": torch.randn(2, 9, 576)}),
        r"its mask is \(1, 7\) torch.bool, but its tokens are \(1, 3\)"),
    "an activation of another batch": (
        lambda p: _write(p, {**_valid(), "resid_post.1": torch.randn(2, 3, 8)}),
        r"resid_post.1 is \(2, 3, 8\), but the cache holds 1 rows of 3 positions"),
    "an activation of other positions": (
        lambda p: _write(p, {**_valid(), "logits": torch.randn(1, 9, 8)}), r"logits is \(1, 9, 8\)"),
    "a pattern of other query positions": (
        lambda p: _write(p, {**_valid(), "pattern.0": torch.randn(1, 2, 5, 3)}),
        r"pattern.0 is \(1, 2, 5, 3\).*\[batch, heads, pos, \.\.\.\]"),
    "float tokens": (
        lambda p: _write(p, {**_valid(), "__tokens__": torch.zeros(1, 3)}), r"its tokens are \(1, 3\) torch.float32"),
    "a mask that is not bool": (
        lambda p: _write(p, {**_valid(), "__mask__": torch.ones(1, 3)}), r"its mask is \(1, 3\) torch.float32"),
    "positions of another batch": (
        lambda p: _write(p, {**_valid(), "__positions__": torch.zeros(4, 1, dtype=torch.long)}),
        r"its positions \(4, 1\)"),
    "no tokens": (
        lambda p: _write(p, {k: v for k, v in _valid().items() if k != "__tokens__"}), r"it holds no __tokens__"),
    "an order that is not JSON": (
        lambda p: _write(p, _valid(), raw_order="{["), r"its 'order' metadata is not JSON"),
    "an order that is not a list": (
        lambda p: _write(p, _valid(), order={"a": 1}), r"not a list of addresses"),
    "an order naming a missing tensor": (
        lambda p: _write(p, _valid(), order=["resid_post.1", "z.0"]), r"names \['z.0'\], which it holds no tensor for"),
    "an order naming a non-address": (
        lambda p: _write(p, {**_valid(), "nonsense.1": torch.randn(1, 3, 8)}), r"an entry of its order is not an address"),
    "a tensor the order does not name": (
        lambda p: _write(p, _valid(), order=[]), r"holds tensors its order does not name: \['resid_post.1'\]"),
}


@pytest.mark.parametrize("case", list(CACHE_FILES))
def test_cache_load_refuses_inconsistent_files(case, tmp_path):
    write, message = CACHE_FILES[case]
    path = write(tmp_path / "c.safetensors")
    with pytest.raises(CacheFileError, match=message) as info:
        Cache.load(path)
    assert str(path) in str(info.value) and "cache.save(path)" in str(info.value)


def _saved(llama, tmp_path):
    path = tmp_path / "real.safetensors"
    run_with_cache(llama, llama.to_tokens(["The quick brown fox", "jumps"]), POINTS).save(path)
    return path


def _truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _huge_header(path):
    path.write_bytes((2**62).to_bytes(8, "little") + b"{}")


def _header_not_json(path):
    path.write_bytes((10).to_bytes(8, "little") + b"\xff" * 10)


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncated, _huge_header, _header_not_json, _empty])
def test_cache_load_refuses_damaged_files(damage, llama, tmp_path):
    path = _saved(llama, tmp_path)
    damage(path)
    with pytest.raises(CacheFileError, match=r"cannot be read as a safetensors file.*damaged or truncated") as info:
        Cache.load(path)
    assert str(path) in str(info.value)


def test_cache_load_refuses_a_folder_and_a_missing_file(tmp_path):
    with pytest.raises(CacheFileError, match="is a folder"):
        Cache.load(tmp_path)
    with pytest.raises(CacheFileError, match="no such file"):
        Cache.load(tmp_path / "absent.safetensors")


def test_real_caches_still_round_trip(llama, tmp_path, unchanged):
    """Every shape a capture makes loads back equal: a padded batch with a pattern, a selection of
    positions and a generation."""
    tokens = llama.to_tokens(["The quick brown fox", "jumps"])
    caches = [
        run_with_cache(llama, tokens, ["resid_post.1", "pattern.0", "z.2", "logits"]),
        run_with_cache(llama, tokens, ["resid_post.1", "pattern.0"], positions=[0, -1]),
        capture_generation(llama, tokens[:1], ["resid_post.1", "pattern.2"], max_tokens=4)[1],
    ]
    for i, cache in enumerate(caches):
        cache.save(tmp_path / f"{i}.safetensors")
        back = Cache.load(tmp_path / f"{i}.safetensors")
        assert_same(back.to_dict(), cache.to_dict())
        assert torch.equal(back.tokens, cache.tokens) and torch.equal(back.mask, cache.mask)
        assert torch.equal(back.positions, cache.positions)


# -- points given as one tuple --------------------------------------------------------------------

def test_a_name_layer_tuple_is_one_point(llama, full_cache, unchanged):
    tokens = full_cache.tokens
    want = run_with_cache(llama, tokens, ["resid_post.1"])
    got = run_with_cache(llama, tokens, ("resid_post", 1))
    assert list(got) == [Address("resid_post", 1)]
    assert_same(got.to_dict(), want.to_dict())
    one = asyncio.run(llama.capture(tokens[:1], ("resid_post", 1)))
    assert list(one) == [Address("resid_post", 1)]
    # a tuple of several addresses is a list of them
    assert list(run_with_cache(llama, tokens, ("resid_post.1", "z.2"))) == [Address("resid_post", 1), Address("z", 2)]


@pytest.mark.parametrize("points, message", [
    (("resid_post", True), r"layer of 'resid_post' must be an int, got True"),
    (("resid_post", 1, 0), r"'resid_post' takes no stream"),
    (("resid_post", 9), r"layers 0\.\.2"),
])
def test_a_bad_name_layer_tuple_is_refused_as_one_point(points, message, llama, full_cache, unchanged):
    with pytest.raises(AddressError, match=message):
        run_with_cache(llama, full_cache.tokens, points)
