"""The address grammar: round trips, tuple form, and errors that list the valid options."""

import dataclasses

import pytest

from interp_engine import Address, AddressError, format_address, parse_address, to_address
from interp_engine.address import FeatureAddress
from interp_engine.points import ModelInfo, check_points
from interp_engine.backends.eager.model import EagerModel
from interp_engine.backends.vllm.model import VllmModel

EAGER, VLLM = EagerModel.capabilities, VllmModel.capabilities
INFO = ModelInfo("m", n_layers=4, d_model=8, n_heads=2, n_kv_heads=1, d_head=4, d_mlp=16, d_vocab=10, n_ctx=32)


@pytest.mark.parametrize("text", ["resid_post.10", "z.7", "logits", "resid_streams.5.2", "pattern.0"])
def test_round_trip(text):
    assert format_address(parse_address(text)) == text
    assert parse_address(format_address(parse_address(text))) == parse_address(text)


@pytest.mark.parametrize("text", ["resid_post.3.features", "resid_post.3.features[2,5]", "mlp_out.1.sae_error",
                                  "z.2.features[7]", "resid_streams.1.0.features"])
def test_feature_points_round_trip(text):
    address = parse_address(text)
    assert isinstance(address, FeatureAddress) and format_address(address) == text
    assert parse_address(str(address)) == address and hash(parse_address(text)) == hash(address)


def test_feature_points_take_transformerlens_names_and_sort_their_ids():
    assert parse_address("blocks.3.hook_resid_post.features") == FeatureAddress(Address("resid_post", 3))
    assert parse_address("blocks.1.hook_mlp_out.sae_error") == FeatureAddress(Address("mlp_out_post", 1), "sae_error")
    assert format_address(parse_address("resid_post.3.features[5,2,5]")) == "resid_post.3.features[2,5]"
    assert format_address(parse_address("blocks.3.hook_resid_post.features"), style="tl") == \
        "blocks.3.hook_resid_post.features"


def test_forms_agree():
    assert parse_address("resid_post.10") == Address("resid_post", 10) == to_address(("resid_post", 10))
    assert to_address(Address("z", 7)) == Address("z", 7)
    assert to_address("resid_streams.5.2") == Address("resid_streams", 5, 2)
    assert str(Address("z", 7)) == "z.7"
    assert hash(Address("z", 7)) == hash(parse_address("z.7"))


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Address("z", 7).layer = 3


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("resid_psot.1", "known sites: resid_pre"),
        ("resid_post", "needs a layer"),
        ("logits.3", "model-level"),
        ("resid_post.x", "integer coordinates"),
        ("resid_post.1.2", "takes no stream"),
        ("resid_streams.1", "needs a stream"),
    ],
)
def test_grammar_errors(bad, fragment):
    with pytest.raises(AddressError, match=fragment):
        parse_address(bad)


def test_checked_against_model():
    assert check_points(["resid_post.3", "logits"], INFO, EAGER) == [Address("resid_post", 3), Address("logits")]
    with pytest.raises(AddressError, match=r"layers 0\.\.3"):
        check_points(["resid_post.4"], INFO, EAGER)
    assert check_points(["resid_post.-1", ("z", -4)], INFO, EAGER) == [Address("resid_post", 3), Address("z", 0)]
    with pytest.raises(AddressError, match=r"layers 0\.\.3.*-1 is layer 3, -4 is layer 0"):
        check_points(["resid_post.-5"], INFO, EAGER)
    with pytest.raises(AddressError, match="single residual stream"):
        check_points(["resid_streams.0.1"], INFO, EAGER)
    with pytest.raises(AddressError, match="dense model.*valid sites: resid_pre"):
        check_points(["router_logits.0"], INFO, EAGER)
    with pytest.raises(AddressError, match="eager-only"):
        check_points(["pattern.0"], INFO, VLLM)
    with pytest.raises(AddressError, match="no points"):
        check_points([], INFO, EAGER)


def test_duplicates_are_captured_once_in_first_order():
    points = ["mlp_out.1", Address("resid_post", 0), ("mlp_out", 1), "resid_post.0"]
    assert check_points(points, INFO, EAGER) == [Address("mlp_out", 1), Address("resid_post", 0)]
