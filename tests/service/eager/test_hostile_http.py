"""Hostile HTTP input to the deployed service (conftest.py's tiny Llama, 2 replicas): the service
counterpart of tests/test_hostile.py. Each case is refused with a short 4xx body that names what
is wrong and how to fix it, before the replica allocates for it; afterwards the service answers a
normal request as the local model does. Slow senders hold no capture slot; uploaded dictionaries
stay within the replica's bound."""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import http.client
import json
import select
import socket
import time
import tracemalloc

import pytest
import torch

from interp_engine import connect, load_dictionary, run_with_cache
from interp_engine.service.held import HeldDictionaries, dictionary_bytes
from interp_engine.service.http_guard import MESSAGE_CHARS, outside_uploads
from interp_engine.service.http_wire import DICTIONARY_FORMAT, dictionary_to_json, encode_tensors, tensor_to_json

from ... import sparse_dicts as sd
from ...oracles import REL_SAME, assert_near
from .served import LIMITS, NAME

ray = pytest.importorskip("ray")

POINTS = ["resid_post.1"]
ROW = [5, 6, 7]
#: an error body: the JSON object and a message of at most MESSAGE_CHARS
BODY_BYTES = MESSAGE_CHARS + 200


def _address(info) -> tuple[str, int]:
    host, port = info.url.split("//")[1].split("/")[0].split(":")
    return host, int(port)


def _send(info, method: str, path: str, data: bytes | dict | None = None, headers: dict | None = None):
    """(status, body) of one request with raw bytes (or a dict as JSON) as its body."""
    connection = http.client.HTTPConnection(*_address(info), timeout=120)
    if isinstance(data, dict):
        data = json.dumps(data).encode()
    sent = {"Authorization": f"Bearer {info.token}", "Content-Type": "application/json", **(headers or {})}
    connection.request(method, f"/{info.name}{path}", body=data, headers=sent)
    answer = connection.getresponse()
    return answer.status, answer.read()


def _still_serves(service, eager) -> None:
    """A normal capture over HTTP equals the local model's."""
    tokens = eager.to_tokens("The quick brown fox")
    got = run_with_cache(connect(service.url, token=service.token), tokens, ["resid_post.1", "logits"])
    want = run_with_cache(eager, tokens, ["resid_post.1", "logits"])
    for point in ("resid_post.1", "logits"):
        assert_near(got[point], want[point], point)


def _refused(status: int, body: bytes, want_status: int, *names: str) -> dict:
    assert len(body) <= BODY_BYTES, body[:300]
    answer = json.loads(body)
    assert status == want_status and set(answer) >= {"error", "message"}, (status, answer)
    for name in names:
        assert name in answer["message"], (name, answer)
    return answer


def _vector(n: int = 128) -> dict:
    return tensor_to_json(torch.ones(n))


#: name -> (path, body, status, what the message names); every one a refusal with a short body
CASES = {
    "boolean token ids": ("/capture", {"tokens": [[True, False]], "points": POINTS}, 400, "tokens[0][0]"),
    "boolean positions": ("/capture", {"tokens": [ROW], "points": POINTS, "positions": True}, 400, "positions"),
    "boolean heads": ("/capture", {"tokens": [ROW], "points": POINTS,
                                   "edits": {"z.0": {"kind": "zero", "heads": [True]}}}, 400, "heads"),
    "boolean max_tokens": ("/generate", {"tokens": [ROW], "points": POINTS, "max_tokens": True}, 400, "max_tokens"),
    "int stop_at_eos": ("/generate", {"tokens": [ROW], "points": POINTS, "stop_at_eos": 1}, 400, "stop_at_eos"),
    "boolean norm_relative": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": {
        "kind": "add", "vector": _vector(), "norm_relative": 1}}}, 400, "norm_relative"),
    "token id 2**70": ("/capture", {"tokens": [[2**70]], "points": POINTS}, 400, "tokens[0][0]"),
    "token id 1e400": ("/capture", b'{"tokens": [[1e400]], "points": ["resid_post.1"]}', 400, "tokens[0][0]"),
    "an int of 5000 digits": ("/capture", b'{"tokens": [[' + b"9" * 5000 + b']], "points": ["resid_post.1"]}', 400,
                              "not JSON"),
    "a string of 60 KB as tokens": ("/capture", {"tokens": "x" * 60000, "points": POINTS}, 400, "tokens"),
    "a dictionary key of 60 KB": ("/capture", {"tokens": [ROW], "points": POINTS, "saes": ["k" * 60000]}, 400,
                                  "saes[0]"),
    "NaN scale": ("/capture", b'{"tokens": [[5]], "points": ["resid_post.1"], "edits": {"resid_post.0": '
                  b'{"kind": "scale", "factor": NaN}}}', 400, "factor"),
    "set without value": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": {"kind": "set"}}},
                          400, "'value'"),
    "add without vector": ("/capture", {"tokens": [ROW], "points": POINTS,
                                        "edits": {"resid_post.0": [{"kind": "add", "scale": 2.0}]}}, 400, "'vector'",
                           "[0]"),
    "scale without factor": ("/capture", {"tokens": [ROW], "points": POINTS,
                                          "edits": {"resid_post.0": {"kind": "scale"}}}, 400, "'factor'"),
    "zero with a factor": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": {
        "kind": "zero", "factor": 2.0}}}, 400, "'factor' is not a field of a 'zero' edit"),
    "set with a vector": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": {
        "kind": "set", "value": _vector(), "vector": _vector()}}}, 400, "'vector' is not a field of a 'set' edit"),
    "bad base64": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": {
        "kind": "add", "vector": {"shape": [128], "data": "!" * 684}}}}, 400, "edits['resid_post.0'].vector", "base64"),
    "a negative shape": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": {
        "kind": "add", "vector": {"shape": [-1], "data": "AAAA"}}}}, 400, "shape"),
    "a shape of 2**80 elements": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": {
        "kind": "add", "vector": {"shape": [2**40, 2**40], "data": "AAAA"}}}}, 400, "shape"),
    "tokenize a boolean": ("/tokenize", {"text": True}, 400, "text"),
    "tokenize 9 texts": ("/tokenize", {"text": ["a"] * 9}, 413, "max_prompts=8"),
    "tokenize a text past max_tokens": ("/tokenize", {"text": "word " * 600}, 413, "max_tokens=512"),
    "2,000 prompts, one 16,000 ids wide": ("/capture", {"tokens": [[1] * 16000] + [[1]] * 1999, "points": POINTS}, 413,
                                          "max_prompts=8"),
    "the same to /generate": ("/generate", {"tokens": [[1] * 16000] + [[1]] * 1999, "points": POINTS}, 413,
                              "max_prompts=8"),
    "one prompt wider than max_tokens": ("/capture", {"tokens": [[1] * 600], "points": POINTS}, 413, "max_tokens=512"),
    "300 edits": ("/capture", {"tokens": [ROW], "points": POINTS, "edits": {"resid_post.0": [{"kind": "zero"}] * 300}},
                  413, f"max_edits={LIMITS.max_edits}"),
    "a response over the bound": ("/capture", {"tokens": [[5] * 100] * 4, "points": ["logits", "mlp_post"]}, 413,
                                  "a response of up to"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_request_is_refused_with_a_short_body_naming_the_field(service, case):
    path, body, status, *names = CASES[case]
    _refused(*_send(service, "POST", path, body), status, *names)


def test_refusals_echo_nothing_and_leave_the_service_serving(service, eager_models):
    status, body = _send(service, "POST", "/capture", {"tokens": "x" * 60000, "points": POINTS})
    assert status == 400 and b"xxxxxxxx" not in body
    answer = _refused(*_send(service, "GET", "/o_proj/30"), 400, "layer 30 is out of range", "0..2")
    assert answer["error"] == "AddressError"
    _refused(*_send(service, "GET", "/o_proj/x"), 400, "layer")
    _still_serves(service, eager_models("llama"))


def test_a_dictionary_upload_without_options_is_refused_naming_it(service, eager_models):
    sae = sd.sae(seed=5)
    tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    no_options = base64.b64encode(encode_tensors(tensors, {"format": DICTIONARY_FORMAT, "key": sae.key,
                                                           "reads": "resid_post.1", "writes": "resid_post.1"})).decode()
    body = {"tokens": [ROW], "points": ["resid_post.1.features"], "saes": [sae.key],
            "dictionaries": {sae.key: no_options}}
    header = {"X-Interp-Engine-Dictionaries": "1"}
    _refused(*_send(service, "POST", "/capture", body, header), 400, "'options'", f"dictionaries['{sae.key}']")
    body["dictionaries"] = {sae.key: "!" + dictionary_to_json(sae)[1:]}  # what is not base64 counts as request
    _refused(*_send(service, "POST", "/capture", body, header), 413, "max_request_bytes", "besides dictionaries")
    body["dictionaries"] = {sae.key: "!" * 400}
    _refused(*_send(service, "POST", "/capture", body, header), 400, "base64", f"dictionaries['{sae.key}']")
    _still_serves(service, eager_models("llama"))


def test_limits_are_checked_before_any_array_is_built():
    """The 2,000-row body with one row 16,000 ids wide is refused by count before its rows are
    padded into one [2000, 16000] int64 array (256 MB): tracemalloc sees numpy's allocations."""
    from interp_engine.service.http_api import CaptureRequest, GenerateRequest, _parsed

    class Owner:
        limits = LIMITS

        def checked_points(self, points):
            return points

    from interp_engine import LimitExceeded

    rows = {"tokens": [[1] * 16000] + [[1]] * 1999, "points": POINTS}
    for body, new_tokens in ((CaptureRequest.model_validate(rows), 0), (GenerateRequest.model_validate(rows), 16)):
        tracemalloc.start()
        try:
            with pytest.raises(LimitExceeded, match="max_prompts=8"):
                _parsed(Owner(), body, new_tokens)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, peak


def test_the_dictionaries_header_lifts_the_bound_for_dictionaries_only(service, eager_models):
    """With the header, what is not a dictionary's weights stays under max_request_bytes, checked
    before the body is parsed: a tokens-only body over it is refused, and so is one that is not
    even JSON (parsed first, it would be a 400)."""
    header = {"X-Interp-Engine-Dictionaries": "1"}
    tokens_only = {"tokens": [[1] * 12000] * 2, "points": POINTS}
    assert len(json.dumps(tokens_only)) > LIMITS.max_request_bytes
    _refused(*_send(service, "POST", "/capture", tokens_only, header), 413, "max_request_bytes", "besides dictionaries")
    not_json = b'{"tokens": [[' + b"1," * 40000
    _refused(*_send(service, "POST", "/capture", not_json, header), 413, "max_request_bytes", "besides dictionaries")
    sae = sd.sae(seed=6)
    upload = json.dumps({"tokens": [ROW], "points": POINTS, "saes": [sae.key],
                         "dictionaries": {sae.key: dictionary_to_json(sae)}}).encode()
    assert len(upload) > LIMITS.max_request_bytes > outside_uploads(upload)
    _still_serves(service, eager_models("llama"))


def _big_dictionary(seed: int):
    """A ReLU SAE on resid_post.1 of 790,016 bytes: LIMITS holds one of these, not two."""
    weights = sd.random_weights(seed, d_sae=768)
    return load_dictionary(weights, reads="resid_post.1", name=f"big{seed}")


def test_held_dictionaries_stay_within_their_bound_counted_exactly():
    dictionaries = [_big_dictionary(seed) for seed in range(5)]
    size = dictionary_bytes(dictionaries[0])
    assert size == 4 * (2 * 128 * 768 + 768 + 128)  # W_enc, W_dec, b_enc, b_dec in float32
    held = HeldDictionaries(2 * size + 1)
    for round_ in range(3):
        for d in dictionaries:
            assert held.keep(d.key, d) is d
            assert held.nbytes == sum(dictionary_bytes(held.get(k)) for k in held.keys()) <= held.limit
    assert held.keys() == [d.key for d in dictionaries[-2:]] and held.stats()["dropped"] == 13
    held.get(dictionaries[-2].key)  # used: the other one goes first
    held.keep(dictionaries[0].key, dictionaries[0])
    assert held.keys() == [dictionaries[-2].key, dictionaries[0].key]
    alone = HeldDictionaries(size - 1)  # one over the bound alone is still given back, not kept
    assert alone.keep(dictionaries[0].key, dictionaries[0]) is dictionaries[0] and alone.nbytes == 0


def test_dictionaries_dropped_from_a_replica_are_sent_again(service, eager_models):
    """Three dictionaries, one at a time over HTTP (each replica holds one of them at most):
    every answer equals the local model's; dropped ones were sent again (with 2 replicas, five
    calls A B C A B need a fourth upload at least); each replica's held bytes, counted in the
    status, stay in the bound."""
    local = eager_models("llama")
    tokens = local.to_tokens(["The quick brown fox", "jumps"])
    dictionaries = [_big_dictionary(seed) for seed in (11, 12, 13)]
    model = connect(service.url, token=service.token)
    sent = model.transport.dictionaries_sent
    for d in dictionaries + dictionaries[:2]:
        got = run_with_cache(model, tokens, ["resid_post.1.features", "logits"], saes=d)
        want = run_with_cache(local, tokens, ["resid_post.1.features", "logits"], saes=d)
        for point in ("resid_post.1.features", "logits"):
            assert_near(got[point], want[point], f"{d.name} {point}", REL_SAME)
    assert model.transport.dictionaries_sent - sent >= 4
    for status in (model.status(), connect(NAME).status()):  # each replica, counted in the status
        held = status["dictionaries"]
        assert len(held) == 2, held
        for counted in held.values():
            assert counted["limit"] == LIMITS.max_dictionary_memory_bytes and counted["bytes"] <= counted["limit"]
        assert sum(counted["dropped"] for counted in held.values()) >= 1


def _slow_upload(service) -> socket.socket:
    """A POST that declares 2,000 bytes of body and sends 11."""
    sock = socket.create_connection(_address(service), timeout=120)
    sock.sendall((f"POST /{service.name}/capture HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {service.token}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n").encode() + b'{"tokens": ')
    return sock


def test_slow_uploads_hold_no_capture_slot(service, eager_models):
    """Capture slots + 4 slow uploads (2 replicas x 8 slots + 4) held open: normal captures still
    answer, equal to the local model, before any slow one is answered (within the slow ones'
    grace); then each slow one gets a 408 that names the rate to keep."""
    local = eager_models("llama")
    model = connect(service.url, token=service.token)
    prompts = [local.to_tokens(text) for text in ("Hello there", "over the lazy dog again")]

    def captures():
        return [run_with_cache(model, tokens, POINTS)["resid_post.1"] for tokens in prompts]

    def held() -> int:  # requests the replicas hold: the slow uploads and this status request
        return sum(n or 0 for n in model.status()["queue"].values()) - 1

    slow = [_slow_upload(service) for _ in range(2 * service_slots(service) + 4)]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        deadline = time.monotonic() + 60
        while held() < len(slow) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert held() >= len(slow)
        got = pool.submit(captures).result(timeout=LIMITS.upload_grace_s)
        readable, _, _ = select.select(slow, [], [], 0)
        assert not readable  # the captures above did not wait for them
        for tokens, tensor in zip(prompts, got):
            assert_near(tensor, run_with_cache(local, tokens, POINTS)["resid_post.1"], "beside slow uploads")
        for sock in slow:
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"min_upload_bytes_per_s" in answer and b"11 of 2000 bytes" in answer
    finally:
        for sock in slow:
            sock.close()
        pool.shutdown()
    _still_serves(service, local)


def service_slots(service) -> int:
    return connect(NAME).service.get("max_ongoing_requests", 8)


def test_the_guard_times_slow_bodies_out_and_answers_503_past_the_queue():
    """The ASGI guard alone (no Serve): a body that stops after 11 of 900 bytes gets 408 once its
    grace is over; with one slot and no queue, two requests beside a running one get 503."""
    import asyncio

    from interp_engine.service.auth import token_sha256 as digest
    from interp_engine.service.http_guard import Guard, Slots

    class Owner:
        token_sha256 = digest("t")
        limits = dataclasses.replace(LIMITS, upload_grace_s=1, min_upload_bytes_per_s=1000)
        slots = Slots(1, 0)

    async def inner(scope, receive, send):
        body = (await receive())["body"]
        await asyncio.sleep(0.5)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    guard = Guard(inner, Owner)

    async def post(part: bytes, size: int):
        queue = asyncio.Queue()
        queue.put_nowait({"type": "http.request", "body": part, "more_body": len(part) < size})
        sent = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", b"Bearer t"), (b"content-length", str(size).encode())]
        await guard({"type": "http", "method": "POST", "headers": headers}, queue.get, send)
        return sent[0]["status"], sent[1]["body"]

    async def main():
        started = time.monotonic()
        status, body = await post(b"x" * 11, 900)  # more_body, then nothing comes
        assert status == 408 and b"11 of 900 bytes" in body and 1 <= time.monotonic() - started < 30
        answers = await asyncio.gather(*(post(b"y", 1) for _ in range(3)))
        assert sorted(status for status, _ in answers) == [200, 503, 503]

    asyncio.run(main())
