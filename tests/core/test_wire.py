"""The wire forms (interp_engine/wire.py) give back exactly what was sent: tensors bit for bit
(bfloat16 through numpy), worker requests, edits with their positions spec, and nothing that is
not data."""

from __future__ import annotations

import json

import pytest
import torch

from interp_engine import Add, Scale, Set, Zero
from interp_engine.address import parse_address
from interp_engine.edits import Planned
from interp_engine.errors import InternalError, InputError
from interp_engine.wire import (Packed, WorkerRequest, edit_for_worker, edit_from_worker, edits_for_replica,
                                edits_from_replica, spec_from_json, spec_to_json)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_tensors_come_back_bit_for_bit(dtype):
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    back = Packed.of(t).tensor()
    assert back.dtype == dtype and torch.equal(back.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                               t.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("spec", [None, 3, [0, 2, -1], slice(1, None, 2), "prompt"])
def test_a_positions_spec_survives_json(spec):
    assert spec_from_json(json.loads(json.dumps(spec_to_json(spec)))) == spec


def test_a_worker_request_is_plain_data_and_comes_back_typed():
    vector = torch.arange(4, dtype=torch.float32)
    edit = edit_for_worker(Planned(parse_address("resid_post.1"), Add(vector, 2.0)))
    request = WorkerRequest(("resid_post.1", "z.0"), (0, 3), 5, {"resid_post.1": edit})
    rpc = request.to_rpc()
    assert json.loads(json.dumps({k: v for k, v in rpc.items() if k != "edits"})) == {
        "points": ["resid_post.1", "z.0"], "positions": [0, 3], "after": 5, "features": None}
    assert isinstance(rpc["edits"]["resid_post.1"]["vector"], torch.Tensor)  # a tensor, never a list
    back = WorkerRequest.from_rpc(rpc)
    assert (back.points, back.positions, back.after) == (request.points, request.positions, request.after)
    assert torch.equal(edit_from_worker(back.edits["resid_post.1"]).vector, vector)
    assert WorkerRequest().empty and not back.empty
    with pytest.raises(InternalError, match="WorkerRequest"):
        WorkerRequest.from_rpc({"points": [], "code": "import os"})


def test_an_edit_from_a_list_is_refused_at_the_worker():
    data = edit_for_worker(Planned(parse_address("resid_post.1"), Set(torch.ones(4))))
    with pytest.raises(InternalError, match="not a tensor"):
        edit_from_worker({**data, "value": data["value"].tolist()})


def test_edits_to_a_replica_come_back_equal():
    vector = torch.randn(8, generator=torch.Generator().manual_seed(1))
    edits = {a: (Planned(a, e),) for a, e in [(parse_address("resid_post.2"), Add(vector, 0.5, positions=slice(1, None))),
                                              (parse_address("mlp_out.0"), Scale(3.0, positions=[0, -1])),
                                              (parse_address("z.1"), Zero(heads=(1,)))]}
    z = parse_address("z.1")
    edits[z] = (*edits[z], Planned(z, Scale(2.0)))  # a list of edits on one address keeps its order
    back = edits_from_replica(edits_for_replica(edits))
    assert set(back) == {"resid_post.2", "mlp_out.0", "z.1"}
    assert torch.equal(back["resid_post.2"][0].vector, vector) and back["resid_post.2"][0].positions == slice(1, None)
    assert back["mlp_out.0"][0].factor == 3.0 and back["mlp_out.0"][0].positions == [0, -1]
    assert back["z.1"][0].heads == (1,) and back["z.1"][1].factor == 2.0 and len(back["z.1"]) == 2


def test_a_function_edit_never_reaches_a_replica():
    with pytest.raises(InputError, match="Python function cannot be sent"):
        edits_for_replica({parse_address("resid_post.0"): (Planned(parse_address("resid_post.0"), lambda x: x),)})


def test_values_per_row_are_cut_with_the_rows():
    """A batched-patching value travels whole to the coordinator, which cuts it with the rows of
    each replica's shard (and a value for every position to a one-prompt replica's own width)."""
    from interp_engine.wire import edits_for_rows

    a = parse_address("resid_post.0")
    per_row = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    plain = edits_for_replica({a: (Planned(a, Set(per_row), per_row=2), Planned(a, Scale(2.0)))})
    assert plain["resid_post.0"][0]["rows"] == 2 and plain["resid_post.0"][1]["rows"] == 0
    middle = edits_for_rows(plain, 1, 2, width=3)
    cut = edits_from_replica(middle)["resid_post.0"]
    assert torch.equal(cut[0].value, per_row[1:2, :3]) and cut[1].factor == 2.0
    assert torch.equal(edits_from_replica(edits_for_rows(plain, 0, 2))["resid_post.0"][0].value, per_row[:2])
    assert plain["resid_post.0"][0]["value"].shape == (3, 4, 2)  # the original is left whole


def test_a_dictionary_and_its_work_cross_as_tensors_and_come_back_equal():
    from interp_engine import Set, Zero
    from interp_engine.features.plan import plan_features
    from interp_engine.features.transfer import (dictionary_for_worker, dictionary_from_worker, features_for_worker,
                                                 features_from_worker)

    from .. import sparse_dicts as sd

    sae = sd.sae(k=4)
    data = dictionary_for_worker(sae)
    assert all(isinstance(t, torch.Tensor) for t in data["tensors"].values())
    back = dictionary_from_worker(data)
    assert back.key == sae.key == data["key"] and repr(back) == repr(sae)
    info = type("Info", (), {"n_layers": 3, "d_model": sd.D_MODEL, "n_heads": 4, "d_head": 32, "d_mlp": 256,
                             "name": "tiny"})()
    tokens = torch.zeros(1, 6, dtype=torch.long)
    edits = {"resid_post.1.features[2]": Set(1.5, positions=[1]), "resid_post.1.sae_error": Zero()}
    _, plan = plan_features([parse_address("resid_post.1.features[2,3]")], edits, [sae], info, tokens,
                            writable=frozenset({"resid_post"}))
    work = features_for_worker(plan)
    (attached,) = features_from_worker(work, {sae.key: back})
    want = plan.attached[0]
    assert attached.features == want.features and attached.error == want.error
    assert [p.address for p in attached.feature_edits] == [p.address for p in want.feature_edits]
    assert attached.feature_edits[0].selection.rows == ((1,),) and attached.error_edit.selection is None
    with pytest.raises(InternalError, match="was not sent"):
        features_from_worker(work, {})


def test_an_http_capture_carries_features_as_their_active_entries():
    """The service's HTTP answer (a safetensors file): a dictionary's feature tensor travels as
    compressed rows, a fraction of the dense bytes, and comes back equal."""
    import numpy as np

    from interp_engine.service.http_wire import decode_capture, encode_capture
    from interp_engine.wire import CaptureReply, pack_dict, unpack_dict

    g = torch.Generator().manual_seed(0)
    dense = torch.randn(2, 7, 4096, generator=g)
    features = torch.where(dense > 2.6, dense, torch.zeros(()))  # about 0.5 % active
    resid = torch.randn(2, 7, 64, generator=g)
    tensors = {parse_address("resid_post.3.features"): features, parse_address("resid_post.3"): resid}
    tokens = np.arange(14).reshape(2, 7)
    body = encode_capture(CaptureReply(pack_dict(tensors), tokens, None), ["resid_post.3.features", "resid_post.3"])
    back = decode_capture(body)
    got = unpack_dict(back.tensors)
    assert torch.equal(got[parse_address("resid_post.3.features")], features)
    assert torch.equal(got[parse_address("resid_post.3")], resid) and np.array_equal(back.tokens, tokens)
    nnz = int((features != 0).sum())
    assert len(body) < features.numel() * 4 / 10 and len(body) < resid.numel() * 4 + nnz * 8 + 4096


def test_a_completions_logprobs_cross_the_wire_and_http_exactly():
    """Logprobs (and each step's top tokens, in order) come back from a replica's reply and from
    the service's safetensors metadata as the same floats and ids."""
    import numpy as np

    from interp_engine import Completion
    from interp_engine.service.http_wire import decode_capture, encode_capture
    from interp_engine.wire import GenerationReply

    sent = Completion(" hi", [5, 9], "length", [-0.1234567891234, -2.5],
                      [{5: -0.1234567891234, 7: -3.0}, {11: -1.0, 9: -2.5}])
    reply = GenerationReply(sent.text, sent.token_ids, sent.finish_reason, {}, np.zeros((1, 3), dtype=np.int64),
                            None, sent.scores())
    back = decode_capture(encode_capture(reply, []))
    for got in (Completion.of(reply.text, reply.token_ids, reply.finish_reason, reply.scores),
                Completion.of(back.text, back.token_ids, back.finish_reason, back.scores)):
        assert got == sent and [list(step) for step in got.top_logprobs] == [[5, 7], [11, 9]]
    assert Completion.of("", [], "", None).logprobs is None
