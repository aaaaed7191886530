"""Numbers however a caller holds them (issue 35): a 0-d tensor (``torch.tensor(2.0)``,
``x.norm()``), a numpy scalar or a 0-d numpy array is taken wherever a number is expected (an
edit's factor, scale or value, positions and heads, generation options, addresses, layers,
dictionary options) and gives exactly what the Python number gives; a bool, a complex number, a
tensor of several elements, a NaN are refused with the fix. Edits decoded from plain data (what
a replica or a worker receives) without their value, vector or factor are refused by name, not
with a ``KeyError``. After every refusal the model answers exactly as before.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from interp_engine import Add, Address, InputError, Scale, Set, Zero, run_with_cache
from interp_engine.address import FeatureAddress
from interp_engine.analysis_checks import check_layer
from interp_engine.features import load_dictionary
from interp_engine.generation import Sampling
from interp_engine.wire import edit_from_worker, edits_from_replica

from ..oracles import assert_same

POINTS = ["logits", "resid_post.2"]
ZERO_D = {"0-d tensor": torch.tensor, "numpy scalar": np.float32, "0-d array": np.array}


@pytest.fixture(scope="module")
def llama(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def tokens(llama):
    return llama.to_tokens("numbers in every form")


@pytest.fixture(scope="module")
def plain(llama, tokens):
    return run_with_cache(llama, tokens, POINTS).to_dict()


def edited(llama, tokens, edits):
    return run_with_cache(llama, tokens, POINTS, edits=edits).to_dict()


@pytest.mark.parametrize("form", list(ZERO_D))
def test_an_edit_takes_a_number_in_any_form(llama, tokens, form):
    as_ = ZERO_D[form]
    v = torch.randn(llama.info.d_model, generator=torch.Generator().manual_seed(0))
    for given, python in ((Scale(as_(2.0)), Scale(2.0)), (Add(v, scale=as_(3.0)), Add(v, scale=3.0)),
                          (Set(as_(0.5)), Set(0.5)), (Scale(0.5, positions=as_(1) if form != "numpy scalar"
                                                           else np.int64(1)), Scale(0.5, positions=1))):
        assert_same(edited(llama, tokens, {"resid_post.1": given}), edited(llama, tokens, {"resid_post.1": python}))
    heads = [torch.tensor(1), np.int64(2)]
    assert_same(edited(llama, tokens, {"z.1": Zero(heads=heads)}), edited(llama, tokens, {"z.1": Zero(heads=[1, 2])}))


#: what is not one finite number (built inside the test: tests/markers.py reads parameters by value)
NOT_ONE_NUMBER = {
    "1-element tensor": (lambda: torch.tensor([2.0]),
                         "must be a number (a float, a numpy scalar or a 0-d tensor), got Tensor[1] float32"),
    "numpy vector": (lambda: np.array([1.0, 2.0]), "must be a number"),
    "bool tensor": (lambda: torch.tensor(True), "must be a number"),
    "numpy bool": (lambda: np.bool_(True), "must be a number"),
    "complex tensor": (lambda: torch.tensor(1 + 2j), "must be a number"),
    "string": (lambda: "2", "must be a number"),
    "NaN tensor": (lambda: torch.tensor(float("nan")), "must be a finite number"),
    "beyond float32": (lambda: np.float64(1e300), "must be a finite number within float32"),
}


@pytest.mark.parametrize("case", list(NOT_ONE_NUMBER))
def test_what_is_not_one_number_is_refused(llama, tokens, plain, case):
    make, words = NOT_ONE_NUMBER[case]
    with pytest.raises(InputError, match=re.escape(words)):
        edited(llama, tokens, {"resid_post.1": Scale(make())})
    assert_same(run_with_cache(llama, tokens, POINTS).to_dict(), plain)


def test_options_addresses_and_layers_take_numbers_in_any_form():
    assert Sampling(max_tokens=torch.tensor(3), temperature=np.float64(0.5), top_p=np.array(0.5),
                    top_k=np.int32(4), seed=torch.tensor(7)) == Sampling(max_tokens=3, temperature=0.5, top_p=0.5,
                                                                         top_k=4, seed=7)
    assert type(Sampling(max_tokens=torch.tensor(3)).max_tokens) is int
    for bad in ({"max_tokens": torch.tensor(2.5)}, {"max_tokens": torch.tensor(True)}, {"top_p": torch.ones(2)},
                {"temperature": np.bool_(False)}):
        with pytest.raises(InputError, match="must be"):
            Sampling(**bad)
    assert Address("resid_post", torch.tensor(3)) == Address("resid_post", 3)
    assert type(Address("resid_post", np.int64(3)).layer) is int
    assert FeatureAddress(Address("resid_post", 1), "features", [torch.tensor(5), np.int16(2)]).ids == (2, 5)
    assert check_layer("logit_lens", torch.tensor(-1), 4, "the final norm") == 4
    w = {"W_enc": torch.randn(8, 16), "b_enc": torch.zeros(16), "W_dec": torch.randn(16, 8), "b_dec": torch.zeros(8)}
    assert load_dictionary(w, reads="resid_post.1", k=torch.tensor(3)).key == load_dictionary(
        w, reads="resid_post.1", k=3).key
    assert load_dictionary(w, reads="resid_post.1", norm_scaling_factor=np.float32(0.25)).norm_scale == 0.25


@pytest.mark.parametrize("data, words", [
    ({"kind": "set", "positions": None}, "'set' edit without 'value': it needs the value it writes"),
    ({"kind": "add", "positions": None, "scale": 1.0}, "'add' edit without 'vector': it needs the vector it adds"),
    ({"kind": "scale", "positions": None}, "'scale' edit without 'factor': it needs the number"),
    ({"kind": "cap", "positions": None, "max": 1.0}, "'cap' edit without 'direction': it needs the direction"),
    ({"kind": "sett", "positions": None},
     "an edit's kind must be one of 'add', 'scale', 'set', 'zero', 'ablate', 'cap', 'swap', 'rotate', got 'sett'"),
    ({"positions": None}, "an edit's kind must be one of"),
])
def test_an_edit_decoded_from_data_without_its_value_is_refused_by_name(data, words):
    with pytest.raises(InputError, match=re.escape(words)):
        edits_from_replica({"resid_post.1": [data]})
    with pytest.raises(InputError, match=re.escape(words)):
        edit_from_worker(data)
    vector = torch.ones(4)
    assert torch.equal(edit_from_worker({"kind": "add", "vector": vector}).vector, vector)  # shape, scale: defaults


def test_service_limits_and_replica_counts_take_numbers_in_any_form():
    """Limits and the replica counts of serve() read numbers as the rest of the API does: a numpy
    integer or a 0-d tensor is the plain int it holds (what /info then publishes as JSON); bools and
    fractions are refused."""
    from interp_engine.service import Limits
    from interp_engine.service.app import scaling_of

    limits = Limits(max_prompts=np.int64(8), max_tokens=torch.tensor(512))
    assert (limits.max_prompts, limits.max_tokens) == (8, 512) and type(limits.max_prompts) is int
    assert scaling_of(torch.tensor(2), None, None) == {"num_replicas": 2}
    assert scaling_of(np.int32(1), None, np.int64(3))["autoscaling_config"]["max_replicas"] == 3
    for bad in (True, 2.5, torch.tensor(2.5), torch.ones(2)):
        with pytest.raises(ValueError, match="max_prompts must be a positive int"):
            Limits(max_prompts=bad)
        with pytest.raises(InputError, match="replicas must be a positive int"):
            scaling_of(bad, None, None)
