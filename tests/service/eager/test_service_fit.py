"""The HTTP client cuts a batch by the limits the service publishes in ``GET /info`` (issue 36):
a batch larger than ``max_prompts`` on every replica, and a dataset build whose shards are larger,
succeed and equal the local model; what no cut can fix is refused before sending, naming the
argument the caller controls. On the package's service (conftest.py; ``max_prompts=8``, 2 replicas)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import LimitExceeded, build_dataset, connect, run_with_cache

from ...oracles import assert_near, torch_threads
from .. import service_client
from .served import LIMITS, NAME, REPLICA

ray = pytest.importorskip("ray")

#: 2.5 times max_prompts on each of the 2 replicas: a cut per replica alone is refused (413)
PROMPTS = [service_client.PROMPTS[i % 6] * (1 + i % 2) for i in range(5 * LIMITS.max_prompts)]


def test_a_batch_over_max_prompts_is_cut_to_fit_and_equals_the_local_model(service, eager_models, tmp_path):
    eager = eager_models("llama")
    model = connect(service.url, token=service.token)
    assert model.limits == LIMITS
    tokens = eager.to_tokens(PROMPTS)
    points = ["resid_post.1", "z.0"]
    want = run_with_cache(eager, tokens, points)
    got = run_with_cache(model, tokens, points)
    assert torch.equal(got.tokens, want.tokens)
    for point in points:
        assert_near(got[point], want[point], point)
    with torch_threads(REPLICA["torch_threads"]):
        local = build_dataset(eager, PROMPTS, ["resid_post.1"], tmp_path / "local", shard_size=len(PROMPTS),
                              progress=False)
    over_http = build_dataset(model, PROMPTS, ["resid_post.1"], tmp_path / "http", shard_size=len(PROMPTS),
                              progress=False)
    assert over_http.to_arrow().equals(local.to_arrow())


def test_what_no_cut_fits_is_refused_before_sending_naming_the_argument(service):
    model = connect(service.url, token=service.token)
    tokens = torch.tensor([[5] * 200])  # two [4 heads, 200, 200] float32 patterns: 1.28 MB, over 1 MiB
    with pytest.raises(LimitExceeded, match=r"max_response_bytes=1048576, even alone.*positions="):
        run_with_cache(model, tokens, ["pattern.0", "pattern.1"])
    assert model.transport.resent == 0
    last = run_with_cache(model, tokens, ["pattern.0", "pattern.1"], positions=-1)  # the fix the message names
    assert last["pattern.0"].shape == (1, 4, 1, 200)


def test_interp_engine_status_shows_url_model_backend_and_replicas(service, tiny_path, capsys):
    import argparse

    from interp_engine.service.cli import _status

    assert _status(argparse.Namespace(name=NAME, json=False)) == 0
    line = capsys.readouterr().out
    assert f"{service.url}, model {tiny_path('llama')} (eager), replicas: 2 running" in line, line
