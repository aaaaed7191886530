"""No message prints a whole tensor (issue 26, item 6): wherever a user's value is quoted — an
edit, a factor, heads, positions, points, sampling options — a tensor shows as its shape and
dtype (``Tensor[576] float32``). The checks run in the front end, the same code on every backend
(tests/vllm/test_tl_vllm.py repeats one on vLLM)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from interp_engine import Add, Address, InputError, Scale, Set, Zero, capture_generation, run_with_cache
from interp_engine.errors import shown

#: a tensor whose numbers would be recognisable in a message (1000.0 .. 1575.0)
BIG = torch.arange(576.0) + 1000


def _message(call) -> str:
    with pytest.raises((InputError, ValueError, TypeError)) as info:
        call()
    return str(info.value)


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


CASES = {
    "a tensor as an edit": lambda m, t: run_with_cache(m, t, ["logits"], edits={"resid_post.1": BIG}),
    "a tensor as a factor": lambda m, t: run_with_cache(m, t, ["logits"], edits={"resid_post.1": Scale(BIG)}),
    "a tensor as heads": lambda m, t: run_with_cache(m, t, ["logits"], edits={"z.1": Zero(heads=BIG[:2].reshape(1, 2))}),
    "a tensor as norm_relative": lambda m, t: run_with_cache(
        m, t, ["logits"], edits={"resid_post.1": Add(torch.ones(m.d_model), norm_relative=BIG)}),
    "a float tensor as positions": lambda m, t: run_with_cache(m, t, ["logits"], positions=BIG),
    "a tensor as an edit's positions": lambda m, t: run_with_cache(
        m, t, ["logits"], edits={"resid_post.1": Zero(positions=BIG)}),
    "a tensor as a layer": lambda m, t: run_with_cache(m, t, [Address("resid_post", BIG)]),
    "a tensor as the temperature": lambda m, t: capture_generation(m, t, ["logits"], max_tokens=2, temperature=BIG),
    "a NaN in a big vector": lambda m, t: run_with_cache(
        m, t, ["logits"], edits={"resid_post.1": Add(torch.cat([BIG[:m.d_model - 1], torch.tensor([float("nan")])]))}),
    "a value of the wrong width": lambda m, t: run_with_cache(m, t, ["logits"], edits={"resid_post.1": Set(BIG)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_messages_show_a_tensor_as_its_shape(model, case):
    tokens = model.to_tokens("short errors")
    message = _message(lambda: CASES[case](model, tokens))
    assert len(message) < 600, f"{case}: a {len(message)}-character message"
    assert not re.search(r"1[0-5]\d\d\.", message), f"{case}: the tensor's numbers are in the message: {message}"


def test_an_edit_shows_as_its_kind_shape_and_options():
    assert repr(Add(BIG, scale=8.0)) == "Add(Tensor[576] float32, scale=8.0)"
    assert repr(Set(BIG.reshape(2, 288), positions=[3])) == "Set(Tensor[2, 288] float32, positions=[3])"
    assert repr(Scale(0.5)) == "Scale(0.5)" and repr(Zero(heads=[1])) == "Zero(heads=[1])" and repr(Zero()) == "Zero()"
    assert repr(Scale(np.float32(2.0))) == "Scale(2.0)"
    assert shown(np.zeros((2, 3))) == "ndarray[2, 3] float64" and shown(torch.tensor(3.0)) == "Tensor(3.0) float32"
    assert shown(list(range(100))) == "list of 100: [0, 1, 2, ...]"
