"""The backend contract checked on a loaded model (see interp_engine/protocol.py): the base
Protocol always, and exactly the capabilities that kind of model should have."""

from __future__ import annotations

from interp_engine import CaptureBackend, HasOProj, HasUnembedding, WritesShards


def assert_contract(model, *, writes_shards: bool) -> None:
    assert isinstance(model, CaptureBackend), f"{type(model).__name__} misses part of CaptureBackend"
    assert isinstance(model, HasUnembedding), f"{type(model).__name__} has no final norm / unembedding"
    assert isinstance(model, HasOProj), f"{type(model).__name__} has no o_proj_weight"
    assert isinstance(model, WritesShards) == writes_shards
    facts = model.facts()
    assert facts["model_dtype"] == model.dtype and len(facts["weights_sha256"]) == 64
    assert model.points() and len(model.to_str_tokens("Hello there")) == model.to_tokens("Hello there").shape[1]
