"""Sparse dictionaries through the deployed service (conftest.py): dictionaries reach the replicas
by content key, through Ray and over HTTP; the features are encoded there; results equal the
local model's; an upload under the wrong key or over a limit is refused."""

from __future__ import annotations

import json

import pytest
import torch

from interp_engine import Set, Zero, build_dataset, capture_generation, connect, feature_dashboard, run_with_cache
from interp_engine.service.http_wire import dictionary_to_json, tensor_to_json

from ... import sparse_dicts as sd
from ...oracles import REL_SAME, assert_near
from .. import service_client
from .served import LIMITS, NAME, raw_http

ray = pytest.importorskip("ray")


def test_features_through_ray_and_http_equal_the_local_model(service, eager_models, tmp_path):
    """Dictionaries reach the replicas by content key (through Ray: put in the object store once;
    over HTTP: a replica that lacks one answers 409 and the request comes again with the weights,
    once per replica), the features are encoded there, and the captures, feature edits, generation,
    dataset and dashboard equal the local model's within the equality contract."""

    local = eager_models("llama")
    prompts = list(service_client.PROMPTS[:5])
    tokens = local.tok.to_tokens(prompts)
    sae, tc = sd.sae(k=12), sd.transcoder()
    points = ["resid_post.1.features", "resid_post.1.features[2,5]", "resid_post.1.sae_error",
              "resid_mid.1.features", "mlp_out.1.sae_error", "logits"]
    edits = {"resid_post.1.features[5]": Set(4.0, positions=[-1]), "mlp_out.1.sae_error": Zero()}
    want = {i: run_with_cache(local, tokens, points, saes=[sae, tc], **kwargs)
            for i, kwargs in enumerate(({}, {"edits": edits}))}
    over_http = connect(service.url, token=service.token)
    for model in (over_http, connect(NAME)):  # HTTP first: the replicas hold no dictionary yet
        for i, kwargs in enumerate(({}, {"edits": edits})):
            got = run_with_cache(model, tokens, points, saes=[sae, tc], **kwargs)
            assert list(got) == list(want[i])
            for point in points:
                assert_near(got[point], want[i][point], f"{model.transport.kind} {point}", REL_SAME)
        steer = dict(max_tokens=4, saes=sae, edits={"resid_post.1.features[7]": Set(8.0)})
        one = local.to_tokens(prompts[0])
        got_c, got = capture_generation(model, one, ["resid_post.1.features[7]"], **steer)
        want_c, _ = capture_generation(local, one, ["resid_post.1.features[7]"], **steer)
        assert got_c.token_ids == want_c.token_ids and (got["resid_post.1.features[7]"] == 8.0).all()
        if model is over_http:  # both dictionaries, to each of the (at most 2) replicas that asked; the
            # client sends a call's pieces at once (one per replica), and two pieces that Serve routes
            # to the same replica before it holds them are both answered 409: at most once per piece
            assert 2 <= over_http.transport.dictionaries_sent <= 2 * 2 * 2
    before = over_http.transport.dictionaries_sent
    for _ in range(4):
        run_with_cache(over_http, tokens, ["resid_post.1.features"], saes=sae)
    assert over_http.transport.dictionaries_sent - before <= 1  # a replica the calls above never reached

    kwargs = dict(layout="token", shard_size=2, progress=False, saes=sae)
    base = build_dataset(local, prompts, ["resid_post.1.features"], tmp_path / "local", **kwargs)
    dash_local = feature_dashboard(local, prompts, [sae], tmp_path / "dl", top_k=3, shard_size=2)
    for model in (connect(NAME), over_http):
        kind = model.transport.kind
        ds = build_dataset(model, prompts, ["resid_post.1.features"], tmp_path / kind, **kwargs)
        assert_near(ds.tensor("resid_post.1.features"), base.tensor("resid_post.1.features"), kind, REL_SAME)
        dash = feature_dashboard(model, prompts, [sae], tmp_path / f"d{kind}", top_k=3, shard_size=2)
        got, ref = dash.features().to_pandas(), dash_local.features().to_pandas()
        assert (got["n_fired"] == ref["n_fired"]).all()
        assert_near(torch.tensor(got["max_activation"].to_numpy()), torch.tensor(ref["max_activation"].to_numpy()),
                    f"{kind} dashboard maxima", REL_SAME)


def test_a_dictionary_sent_under_another_key_is_refused(service):

    one, other = sd.sae(seed=0), sd.sae(seed=1)
    body = {"tokens": [[1, 2, 3]], "points": ["resid_post.1.features"], "saes": [one.key],
            "dictionaries": {one.key: dictionary_to_json(other)}}
    status, _, data = raw_http(service, "POST", "/capture", body, headers={"X-Interp-Engine-Dictionaries": "1"})
    assert status == 400 and "another dictionary's" in json.loads(data)["message"]
    status, _, data = raw_http(service, "POST", "/capture", {**body, "dictionaries": None})
    assert status == 409  # nothing was kept from the refused upload, on either replica
    assert json.loads(data) == {"error": "MissingDictionary", "keys": [one.key],
                                "message": json.loads(data)["message"]}
    status, _, _ = raw_http(service, "POST", "/capture", {**body, "dictionaries": {one.key: dictionary_to_json(one)}})
    assert status == 413  # without the header, weights count against max_request_bytes
    # with it, what is not weights still does
    vector = tensor_to_json(torch.zeros(LIMITS.max_request_bytes // 3))
    big = {"tokens": [[1, 2, 3]], "points": ["resid_post.1"], "edits": {"resid_post.1": {"kind": "add", "vector": vector}}}
    status, _, data = raw_http(service, "POST", "/capture", big, headers={"X-Interp-Engine-Dictionaries": "1"})
    assert status == 413 and "max_request_bytes" in json.loads(data)["message"]
