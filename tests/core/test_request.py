"""A request's points are checked once, where the user gave them: not again per dataset shard,
per batch of a shard, per row of a one-prompt engine, or per replica of a cluster
(interp_engine/request.py)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import build_dataset, run_with_cache
from interp_engine import request as request_module
from interp_engine.actors.coordinator import CoordinatorCore
from interp_engine.actors.replica import ReplicaCore, ReplicaSpec
from interp_engine.actors.scheduler import LocalExecutor
from interp_engine.cluster.model import ClusterModel
from interp_engine.model import CaptureModel
from interp_engine.request import Points, Request

POINTS = ["resid_post.0", "mlp_out.1"]


@pytest.fixture
def counted(monkeypatch):
    """Every call of check_points made through a request, counted."""
    calls = []
    real = request_module.check_points

    def counting(points, info, caps):
        calls.append(points)
        return real(points, info, caps)

    monkeypatch.setattr(request_module, "check_points", counting)
    return calls


def test_a_call_checks_its_points_once_and_a_checked_request_runs_as_given(eager_models, counted):
    model = eager_models("llama")
    tokens = model.tok.to_tokens(["The cat sat", "on the mat"])
    request = model.request(tokens, POINTS)
    assert isinstance(request, Request) and isinstance(request.points, Points) and len(counted) == 1
    assert [str(a) for a in request.points] == POINTS
    via_call = run_with_cache(model, tokens, POINTS)
    assert len(counted) == 2  # that call checked its own points, once
    executed = model.execute(request)
    assert len(counted) == 2 and list(executed) == list(via_call)
    for address in via_call:  # the same computation: the same batch through the same model
        assert torch.equal(executed[address], via_call[address]), address
    # checked points passed on are not checked again, however many rows they serve
    model.run_many([tokens[:1], tokens[1:]], request.points)
    assert len(counted) == 2


def test_checked_points_still_refuse_what_was_never_checked(eager_models):
    model = eager_models("llama")
    from interp_engine import AddressError

    with pytest.raises(AddressError, match="layer 99"):
        model.request(model.tok.to_tokens(["hi"]), ["resid_post.99"])


def test_one_dataset_build_checks_its_points_once(eager_models, tmp_path, counted):
    model = eager_models("llama")
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(12)]
    ds = build_dataset(model, prompts, POINTS, tmp_path / "ds", shard_size=4, batch_tokens=16)
    assert len(ds.manifest["shards"]) == 3
    assert len(counted) == 1, f"check_points ran {len(counted)} times for one build of 3 shards"


def test_a_cluster_request_is_checked_on_the_driver_only(tiny_path, eager_models, counted):
    """The driver's ClusterModel checks a call as every model does (CaptureModel.request); the
    coordinator and replicas run the strings it sends without checking them again."""
    assert ClusterModel.request is CaptureModel.request and ClusterModel.check_points is CaptureModel.check_points
    local = eager_models("llama")
    tokens = local.tok.to_tokens(["The cat sat", "on", "a mat, said the dog"])
    cores = [ReplicaCore(ReplicaSpec(str(tiny_path("llama"))), i) for i in range(2)]
    checked = local.check_points(POINTS)
    assert len(counted) == 1
    for batched in (True, False):  # a batch split over replicas; one prompt per call on each
        CoordinatorCore(LocalExecutor(cores), 2, batched=batched).run(tokens.numpy(), list(checked.strings()))
    CoordinatorCore(LocalExecutor(cores), 2, batched=False).generate(local.tok.to_tokens(["The cat sat"]).numpy(), list(checked.strings()),
                                                                     {"max_tokens": 2})
    assert len(counted) == 1, f"replicas checked the points again ({len(counted) - 1} times)"
