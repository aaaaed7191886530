"""Hostile dictionaries (issue 35): weights that are not finite, SAELens folders whose config
disagrees with their weights, a hook counted from the end, and a ``params.npz`` that is no npz.

Each is refused with a :class:`DictionaryError` naming what is wrong and the fix, on every path a
dictionary is made by: a dict of tensors, a SAELens folder, a Gemma Scope ``params.npz``, the
service's upload (``http_wire.dictionary_from_json``, what a replica rebuilds from a request) and
the constructor. Where SAELens can load the same folder it is the oracle of what is valid: it
refuses each disagreeing folder here too (strict ``load_state_dict``). After every case the model
answers a normal call, with a dictionary attached, exactly (``torch.equal``) as before.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from interp_engine import run_with_cache
from interp_engine.errors import DictionaryError
from interp_engine.features import Dictionary, load_dictionary
from interp_engine.service import http_wire
from interp_engine.features.transfer import dictionary_for_worker

from .. import sparse_dicts as sd
from ..oracles import assert_same
from .test_features_load import D_SAE, check, inputs, saelens_folder, v6, weights

try:
    import sae_lens
except ImportError:  # pragma: no cover - depends on the environment (see test_features_saelens.py)
    sae_lens = None

POINTS = ["logits", "resid_post.1", "resid_post.1.features"]


@pytest.fixture(scope="module")
def llama(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def baseline(llama):
    tokens = llama.to_tokens(["hostile dictionaries", "are refused"])
    good = sd.sae("resid_post.1", jumprelu=True)
    return tokens, good, run_with_cache(llama, tokens, POINTS, saes=[good]).to_dict()


@pytest.fixture(autouse=True)
def unchanged(llama, baseline):
    """After each case, the model answers the same call bit for bit."""
    yield
    tokens, good, want = baseline
    assert_same(run_with_cache(llama, tokens, POINTS, saes=[good]).to_dict(), want)


def saelens_refuses(folder) -> None:
    """SAELens's own loader refuses the folder too (where SAELens imports)."""
    if sae_lens is not None:
        with pytest.raises(Exception):  # noqa: B017 - SAELens raises RuntimeError / KeyError
            sae_lens.SAE.load_from_disk(folder)


# -- weights that are not finite -------------------------------------------------------------

#: tensor -> (where the bad value goes (None: everywhere), the value): one NaN in W_enc, an inf
#: bias, an all-inf decoder, a NaN JumpReLU threshold, a NaN skip connection
BAD = {"W_enc": ((3, 5), float("nan")), "b_enc": ((7,), float("inf")), "W_dec": (None, float("inf")),
       "b_dec": ((2,), -float("inf")), "threshold": ((4,), float("nan")), "W_skip": ((1, 0), float("nan"))}


def poisoned(name: str) -> tuple[dict, dict, int, list[int]]:
    """(weights with ``name`` poisoned, load options, count of bad entries, index of the first)."""
    w = weights(threshold=name == "threshold", skip=name == "W_skip", d_out=16)
    where, value = BAD[name]
    if where is None:
        w[name] = torch.full_like(w[name], value)
    else:
        w[name][where] = value
    options = {"reads": "resid_mid.1", "writes": "mlp_out.1"} if name == "W_skip" else {"reads": "resid_post.1"}
    count = w[name].numel() if where is None else 1
    return w, options, count, [0] * w[name].dim() if where is None else list(where)


def refused_naming(name: str, count: int, first: list[int]):
    return pytest.raises(DictionaryError, match=rf"{name} \(float32\) holds {count} non-finite values? .* at index "
                                                rf"\[{', '.join(map(str, first))}\]")


@pytest.mark.parametrize("name", list(BAD))
def test_non_finite_weights_are_refused_from_tensors(name):
    w, options, count, first = poisoned(name)
    with refused_naming(name, count, first):
        load_dictionary(w, **options)


@pytest.mark.parametrize("name", list(BAD))
def test_non_finite_weights_are_refused_from_a_saelens_folder(tmp_path, name):
    w, options, count, first = poisoned(name)
    architecture = {"threshold": "jumprelu", "W_skip": "skip_transcoder"}.get(name, "standard")
    extra = ({"d_out": 16, "apply_b_dec_to_input": False, "metadata": {"hook_name_out": "blocks.1.hook_mlp_out"}}
             if name == "W_skip" else {})
    folder = saelens_folder(tmp_path / name, v6(architecture, hook="blocks.1.hook_resid_mid", **extra), w)
    with refused_naming(name, count, first):
        load_dictionary(folder)


@pytest.mark.parametrize("name", list(BAD))
def test_non_finite_weights_are_refused_when_uploaded(name):
    """A service replica rebuilds an uploaded dictionary with ``dictionary_from_json``: the same
    check refuses it there (the HTTP layer answers 400 for a DictionaryError)."""
    w, options, count, first = poisoned(name)
    finite = {k: torch.nan_to_num(v, nan=0.5, posinf=1.0, neginf=-1.0) for k, v in w.items()}
    data = dictionary_for_worker(load_dictionary(finite, **options))
    data["tensors"][name] = w[name]
    metadata = {"format": http_wire.DICTIONARY_FORMAT, "key": data["key"], "options": json.dumps(data["options"]),
                "reads": data["reads"], "writes": data["writes"]}
    text = base64.b64encode(http_wire.encode_tensors(data["tensors"], metadata)).decode()
    with refused_naming(name, count, first):
        http_wire.dictionary_from_json(text, data["key"])


def test_non_finite_weights_are_refused_from_npz_and_by_the_constructor(tmp_path):
    w, options, count, first = poisoned("W_enc")
    np.savez(tmp_path / "params.npz", **{k: v.numpy() for k, v in w.items()})
    with refused_naming("W_enc", count, first):
        load_dictionary(tmp_path / "params.npz", reads="resid_post.1", activation="relu")
    good = load_dictionary(weights(), reads="resid_post.1")
    with refused_naming("W_enc", count, first):
        dataclasses.replace(good, W_enc=w["W_enc"])


def test_weights_that_overflow_the_dtype_asked_for_are_refused():
    w = weights()
    w["W_dec"][0, 0] = 1e6  # beyond float16's 65504: inf once converted
    assert load_dictionary(w, reads="resid_post.1").W_dec.isfinite().all()
    with pytest.raises(DictionaryError, match=r"W_dec \(float16\) holds 1 non-finite value .* fit that dtype"):
        load_dictionary(w, reads="resid_post.1", dtype="float16")


def test_a_nan_weight_never_reaches_the_model(llama, baseline):
    """The issue's case: one NaN in W_enc, then Zero() on one feature, made every logit NaN."""
    w = sd.random_weights(0)
    w["W_enc"][0, 0] = float("nan")
    with pytest.raises(DictionaryError, match="W_enc"):
        load_dictionary(w, reads="resid_post.1")


# -- SAELens configs that disagree with their weights ------------------------------------------

@pytest.mark.parametrize("architecture, extra, tensors, match", [
    ("standard", {}, {"threshold"}, r"\['threshold'\], which a 'standard' .*\"architecture\": \"jumprelu\""),
    ("topk", {"k": 4}, {"threshold"}, r"\['threshold'\], which a 'topk'"),
    ("standard", {}, {"log_threshold"}, r"\['log_threshold'\], which a 'standard'"),
    ("standard", {}, {"W_skip"}, r"\['W_skip'\], which a 'standard'"),
    ("jumprelu", {}, {"threshold", "W_mystery"}, r"\['W_mystery'\], which a 'jumprelu'"),
    ("standard", {"d_sae": 128}, set(), r"d_sae=128, but the weights have 48"),
    ("standard", {"d_in": 512}, set(), r"d_in=512, but the weights have 16"),
])
def test_a_config_that_disagrees_with_the_weights_is_refused(tmp_path, architecture, extra, tensors, match):
    w = weights(threshold="threshold" in tensors, skip="W_skip" in tensors)
    if "log_threshold" in tensors:
        w["log_threshold"] = torch.rand(D_SAE).log()
    if "W_mystery" in tensors:
        w["W_mystery"] = torch.zeros(3)
    folder = saelens_folder(tmp_path / "sae", v6(architecture, **extra), w)
    with pytest.raises(DictionaryError, match=match):
        load_dictionary(folder)
    saelens_refuses(folder)


def test_a_transcoder_config_whose_d_out_is_not_the_weights_is_refused(tmp_path):
    cfg = v6("transcoder", hook="blocks.3.hook_resid_mid", d_out=24, apply_b_dec_to_input=False,
             metadata={"hook_name_out": "blocks.3.hook_mlp_out"})
    folder = saelens_folder(tmp_path / "tc", cfg, weights(d_out=12))
    with pytest.raises(DictionaryError, match=r"d_out=24, but the weights have 12"):
        load_dictionary(folder)
    saelens_refuses(folder)


def test_a_v5_topk_config_beside_a_threshold_is_refused(tmp_path):
    cfg = {"d_in": 16, "d_sae": D_SAE, "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 4},
           "apply_b_dec_to_input": True, "hook_name": "blocks.1.hook_resid_post", "dtype": "float32"}
    folder = saelens_folder(tmp_path / "v5", cfg, weights(threshold=True))
    with pytest.raises(DictionaryError, match=r"\['threshold'\], which a 'topk'"):
        load_dictionary(folder)
    saelens_refuses(folder)


def test_a_config_without_architecture_is_jumprelu_where_a_threshold_is_present(tmp_path):
    """Never a ReLU that drops the threshold: the features are the JumpReLU's, by hand."""
    w = weights(threshold=True)
    cfg = v6("standard")
    del cfg["architecture"]
    d = load_dictionary(saelens_folder(tmp_path / "sae", cfg, w))
    assert d.activation == "jumprelu" and torch.equal(d.threshold, w["threshold"])
    check(d, w, inputs(), act="jumprelu", b_dec_in=True)


def test_a_config_without_architecture_and_no_threshold_is_standard_as_in_saelens(tmp_path):
    """SAELens's pre-6 layout without ``architecture``: both read it as a standard ReLU SAE."""
    w = weights()
    cfg = {"d_in": 16, "d_sae": D_SAE, "activation_fn_str": "relu", "apply_b_dec_to_input": True,
           "hook_name": "blocks.1.hook_resid_post", "dtype": "float32", "normalize_activations": "none"}
    folder = saelens_folder(tmp_path / "v5", cfg, w)
    d = load_dictionary(folder)
    assert d.activation == "relu"
    check(d, w, inputs(), b_dec_in=True)
    if sae_lens is not None:
        x = inputs()
        with torch.no_grad():
            assert torch.allclose(d.encode(x), sae_lens.SAE.load_from_disk(folder).encode(x), atol=1e-5)


def test_k_for_a_dictionary_that_is_not_topk_is_refused(tmp_path):
    folder = saelens_folder(tmp_path / "sae", v6("standard"), weights())
    with pytest.raises(DictionaryError, match="k=4 applies to a topk dictionary"):
        load_dictionary(folder, k=4)
    with pytest.raises(DictionaryError, match="k=4 applies to a topk dictionary only"):
        load_dictionary(weights(), reads="resid_post.1", activation="relu", k=4)
    with pytest.raises(DictionaryError, match="holds a threshold, which only a jumprelu"):
        load_dictionary(weights(threshold=True), reads="resid_post.1", activation="relu")


# -- a hook counted from the end ----------------------------------------------------------------

def test_a_hook_counted_from_the_end_is_refused_with_the_fix(tmp_path):
    folder = saelens_folder(tmp_path / "neg", v6("standard", hook="blocks.-1.hook_resid_post"), weights())
    with pytest.raises(DictionaryError, match=r"reads resid_post.-1, a layer counted from the end.*reads="):
        load_dictionary(folder)
    assert load_dictionary(folder, reads="resid_post.1").reads.layer == 1  # the fix the message names
    for bad in ({"reads": "resid_post.-2"}, {"reads": "blocks.-1.hook_resid_post"},
                {"reads": "resid_mid.1", "writes": "mlp_out.-1"}):
        with pytest.raises(DictionaryError, match="counted from the end"):
            load_dictionary(weights(), **bad)


# -- a params.npz that is not an npz archive ------------------------------------------------------

def test_a_params_npz_that_is_not_an_npz_is_refused_without_suggesting_pickle(tmp_path):
    w = weights(threshold=True)
    text = tmp_path / "text" / "params.npz"
    text.parent.mkdir()
    text.write_text("this is not an archive\n")
    npy = tmp_path / "npy" / "params.npz"
    npy.parent.mkdir()
    with open(npy, "wb") as f:
        np.save(f, w["W_enc"].numpy())
    objects = tmp_path / "obj" / "params.npz"
    objects.parent.mkdir()
    np.savez(objects, W_enc=np.array([{"a": 1}], dtype=object), **{k: v.numpy() for k, v in w.items() if k != "W_enc"})
    strings = tmp_path / "str" / "params.npz"
    strings.parent.mkdir()
    np.savez(strings, W_enc=np.array(["x"]), **{k: v.numpy() for k, v in w.items() if k != "W_enc"})
    truncated = tmp_path / "trunc" / "params.npz"
    truncated.parent.mkdir()
    np.savez(truncated, **{k: v.numpy() for k, v in w.items()})
    whole = truncated.read_bytes()
    truncated.write_bytes(whole[:30] + whole[-200:])  # the directory survives, the members do not
    assert zipfile.is_zipfile(truncated)
    for path, match in ((text, r"is not an npz archive .*starts with b'this is "), (npy, "is not an npz archive"),
                        (objects, "holds Python objects, not numbers"), (strings, "'W_enc' holds <U1 values"),
                        (truncated, "damaged npz archive")):
        with pytest.raises(DictionaryError, match=match) as caught:
            load_dictionary(path, reads="resid_post.1")
        assert "allow_pickle" not in str(caught.value) and "pickle.load" not in str(caught.value)
