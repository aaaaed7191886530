"""``relative_error`` — the comparison behind every ``assert_near`` of the suite — against values
worked out by hand, including the cases that must never read as "near" (NaN, a zero reference)."""

import math

import pytest
import torch

from interp_engine.compare import CROSS_BACKEND, SAME_BACKEND, close, relative_error


@pytest.mark.parametrize("got,want,expected", [
    ([1.0, 2.0, 3.0], [1.0, 2.0, 4.0], 1 / 4),          # max |diff| 1 over max |want| 4
    ([0.0, 0.0], [2.0, -4.0], 4 / 4),                    # the scale is the largest magnitude, sign ignored
    ([-4.0, 2.0], [0.0, 1.0], 4 / 1),                    # against want's scale, not got's
    ([[1.5, 0.0], [0.0, -3.0]], [[1.0, 0.0], [0.0, -2.0]], 1 / 2),  # the largest error anywhere
    ([5.0], [5.0], 0.0),
    ([0.0, 0.0], [0.0, 0.0], 0.0),                       # both all zeros
    ([], [], 0.0),                                       # empty
])
def test_hand_values(got, want, expected):
    assert relative_error(torch.tensor(got), torch.tensor(want)) == pytest.approx(expected, rel=1e-12)


def test_scale_comes_from_the_largest_magnitude_not_elementwise():
    """A small value off by a lot next to a large one is small relative error: the scale is global."""
    want = torch.tensor([1e4, 1.0])
    assert relative_error(torch.tensor([1e4, 2.0]), want) == pytest.approx(1e-4)


def test_a_zero_reference_with_any_error_is_infinitely_far():
    assert relative_error(torch.tensor([1e-30]), torch.tensor([0.0])) == math.inf
    assert not close(torch.tensor([1e-30]), torch.tensor([0.0]))


@pytest.mark.parametrize("got,want", [([math.nan, 1.0], [1.0, 1.0]), ([1.0, 1.0], [math.nan, 1.0]),
                                      ([math.inf, 1.0], [1.0, 1.0])])
def test_nan_and_inf_are_never_near(got, want):
    err = relative_error(torch.tensor(got), torch.tensor(want))
    assert not err <= CROSS_BACKEND
    assert not close(torch.tensor(got), torch.tensor(want), rel=1.0)


def test_dtypes_are_compared_in_float32():
    want = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert relative_error(torch.tensor([1, 3]), want) == pytest.approx(0.5)
    assert relative_error(want.half(), want) == 0.0


def test_shapes_must_agree():
    with pytest.raises(ValueError, match=r"shapes differ: \(2,\) vs \(1, 2\)"):
        relative_error(torch.zeros(2), torch.zeros(1, 2))
    assert not close(torch.zeros(2), torch.zeros(1, 2))


def test_close_is_the_tolerance_inclusive():
    want = torch.tensor([1.0, 0.5])
    assert close(want + torch.tensor([SAME_BACKEND / 2, 0.0]), want)
    assert not close(want + torch.tensor([SAME_BACKEND * 2, 0.0]), want)
    assert close(want + torch.tensor([SAME_BACKEND * 2, 0.0]), want, rel=CROSS_BACKEND)


def test_tensors_that_need_grad_are_detached():
    got = torch.tensor([1.0, 2.0], requires_grad=True)
    assert relative_error(got * 2, torch.tensor([2.0, 2.0])) == pytest.approx(1.0)
