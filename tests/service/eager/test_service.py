"""The capture service on a real Ray Serve (the library's loopback Ray, started in conftest.py): a
tiny Llama deployed with 2 replicas, reached through Ray and over real HTTP from other processes, compared
with the same requests on a local model; authentication, limits, a replica killed under load, a
model that cannot load, and every socket on loopback."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from interp_engine import (AddressError, LimitExceeded, ServiceAuthError, ServiceError, connect,
                           run_with_cache, serve, shutdown)

from ... import ray_exposure
from ...oracles import assert_near
from .. import service_client
from .served import NAME, REPLICA, ROOT, raw_http

ray = pytest.importorskip("ray")


def _same(got: tuple, want: tuple, what: str) -> None:
    """A service result equals the local one: completion exactly, tokens and positions exactly,
    activations within the equality contract (the service splits batches over replicas)."""
    (got_done, got_tensors), (want_done, want_tensors) = got, want
    assert got_done == want_done, what
    assert sorted(got_tensors) == sorted(want_tensors), what
    for key, tensor in want_tensors.items():
        if key in ("tokens", "positions"):
            assert torch.equal(got_tensors[key], tensor), (what, key)
        else:
            assert_near(got_tensors[key], tensor, f"{what} {key}")


def _local(eager, i: int) -> tuple:
    completion, tensors = service_client.request(eager, i)
    done = None if completion is None else [completion.text, list(completion.token_ids), completion.finish_reason]
    return done, {k: v.detach() for k, v in tensors.items()}


def test_clients_in_other_processes_equal_the_local_model(cluster, service, eager_models, tmp_path):
    """Four client processes at once, two through Ray and two over HTTP (with `import ray` made to
    fail: the HTTP client needs no Ray), 20 mixed requests each (batches, generations, edits,
    selections, async captures), each equal to the same request run alone on a local model."""
    count, procs = 20, []
    for n, (target, flags) in enumerate([(NAME, []), (service.url, ["--no-ray"]), (NAME, []),
                                         (service.url, ["--no-ray"])]):
        env = {**cluster["env"], "SERVICE_TOKEN": service.token}
        if flags:
            env.pop("RAY_ADDRESS")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.service.service_client", target, str(tmp_path / str(n)),
                                       str(n), str(count), *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    eager = eager_models("llama")
    local = {i: _local(eager, i) for i in range(count + len(procs))}
    for n in range(len(procs)):
        folder = tmp_path / str(n)
        assert (folder / "ray_imported").read_text() == ("False" if n % 2 else "True")
        for i in range(n, n + count):
            _same(service_client.load(folder, i), local[i], f"client {n} request {i}")


def test_a_connection_is_a_capture_model(service, eager_models):
    """Both connections answer what the local model answers: shape, tokens, points, the logit
    lens (final norm and unembedding fetched from a replica), head contributions, an async
    generation, status."""
    import asyncio

    from interp_engine import capture_generation, head_contributions, lens_top

    eager = eager_models("llama")
    for model in (connect(NAME), connect(service.url, token=service.token)):
        assert (model.n_layers, model.d_model, model.backend) == (eager.n_layers, eager.d_model, "eager")
        assert model.points() == eager.points()
        tokens = model.to_tokens("Paris is in")
        assert torch.equal(tokens, eager.to_tokens("Paris is in"))
        points = ["resid_post", "z.1", "logits"]
        cache, want = run_with_cache(model, tokens, points), run_with_cache(eager, tokens, points)
        assert torch.equal(lens_top(model, cache).ids, lens_top(eager, want).ids)
        assert torch.equal(model.unembed_weight(), eager.unembed_weight().detach())
        assert_near(head_contributions(model, cache, 1), head_contributions(eager, want, 1), "heads")
        completion, generated = asyncio.run(model.capture_generation_async(tokens, ["resid_post.1"], max_tokens=3))
        local, want_generated = capture_generation(eager, tokens, ["resid_post.1"], max_tokens=3)
        assert completion.token_ids == local.token_ids
        assert_near(generated["resid_post.1"], want_generated["resid_post.1"], "capture_generation_async")
        status = model.status()
        assert status["replicas"] == {"RUNNING": 2} and status["health"] == "HEALTHY" and len(status["queue"]) == 2
    assert service.token not in repr(service) and service.token not in repr(model)
    assert Path(service.token_path).read_text() == service.token
    assert Path(service.token_path).stat().st_mode & 0o777 == 0o600


def test_build_dataset_through_a_connection_equals_a_local_build(service, eager_models, tmp_path):
    """Through Ray the deployed replicas write the shards (no replica is started: the manifest names
    the service's own processes); over HTTP the client writes them. Both equal a local build."""
    from interp_engine import build_dataset

    from ...oracles import torch_threads

    eager = eager_models("llama")
    prompts = [service_client.PROMPTS[i % 6] * (1 + i % 3) for i in range(12)]
    with torch_threads(REPLICA["torch_threads"]):
        local = build_dataset(eager, prompts, ["resid_post.1"], tmp_path / "local", shard_size=4, progress=False)
    ray_model = connect(NAME)
    served = {ray_model.transport.call("describe")["pid"] for _ in range(20)}
    through_ray = build_dataset(ray_model, prompts, ["resid_post.1"], tmp_path / "ray", shard_size=4, progress=False)
    assert through_ray.to_arrow().equals(local.to_arrow())
    assert {rec["pid"] for rec in through_ray.manifest["shards"].values()} <= served
    over_http = build_dataset(connect(service.url, token=service.token), prompts, ["resid_post.1"], tmp_path / "http",
                              shard_size=4, progress=False)
    assert over_http.to_arrow().equals(local.to_arrow())


def test_every_request_needs_the_bearer_token(service):
    for path in ("/info", "/ping", "/docs", "/openapi.json", "/nowhere"):
        status, headers, _ = raw_http(service, "GET", path, token=None)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", path
        assert raw_http(service, "GET", path, token="x" + service.token)[0] == 403, path
        assert raw_http(service, "GET", path, headers={"Authorization": f"Basic {service.token}"}, token=None)[0] == 403
    assert raw_http(service, "POST", "/capture", {"tokens": [[1, 2]], "points": ["resid_post.0"]}, token=None)[0] == 401
    status, _, body = raw_http(service, "GET", "/openapi.json")
    assert status == 200 and {"/capture", "/generate", "/info"} <= set(json.loads(body)["paths"])
    assert raw_http(service, "GET", "/docs")[0] == 200
    for path, body in (("/-/healthz", b"success"), ("/-/routes", json.dumps({f"/{NAME}": NAME}, separators=(",", ":")).encode())):
        host, port = service.url.split("//")[1].split("/")[0].split(":")  # Serve's own paths, documented as open
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("GET", path)
        answer = connection.getresponse()
        assert answer.status == 200 and body in answer.read().replace(b" ", b""), path
    with pytest.raises(ServiceAuthError, match="not this service's"):
        connect(service.url, token="wrong")


def test_bad_requests_get_the_librarys_errors(service, eager_models):
    """A request the model refuses is a 400 carrying the library's own error type and message;
    a malformed body is a 400 naming the field; both clients refuse it before sending, with the
    same message; a layer out of range is refused at once, never sent again."""
    eager = eager_models("llama")
    tokens = eager.to_tokens("abc")
    with pytest.raises(AddressError) as local:
        run_with_cache(eager, tokens, ["resid_post.9"])
    status, _, body = raw_http(service, "POST", "/capture", {"tokens": tokens.tolist(), "points": ["resid_post.9"]})
    assert status == 400 and json.loads(body) == {"error": "AddressError", "message": str(local.value)}
    status, _, body = raw_http(service, "POST", "/generate", {"tokens": tokens.tolist(), "points": ["logits"],
                                                           "top_p": 1.5})
    assert status == 400 and "top_p must be" in json.loads(body)["message"]
    status, _, body = raw_http(service, "POST", "/capture", {"tokens": "abc", "points": ["logits"]})
    assert status == 400 and "tokens" in json.loads(body)["message"]
    for model in (connect(NAME), connect(service.url, token=service.token)):  # checked in the client, as locally
        with pytest.raises(AddressError) as remote:
            run_with_cache(model, tokens, ["resid_post.9"])
        assert str(remote.value) == str(local.value)
    started = time.monotonic()  # refused at once, never sent again
    with pytest.raises(AddressError, match="layer 99 is out of range"):
        connect(service.url, token=service.token).o_proj_weight(99)
    with pytest.raises(AddressError, match="layer 99 is out of range"):
        connect(NAME).o_proj_weight(99)
    assert time.monotonic() - started < 60


def test_limits_are_refused_with_413_naming_the_limit(service):
    model = connect(service.url, token=service.token)
    row = [5, 6, 7]
    asks = {"max_prompts": {"tokens": [row] * 9, "points": ["resid_post.0"]},
            "max_tokens": {"tokens": [[5] * 200] * 3, "points": ["resid_post.0"]},
            "max_points": {"tokens": [row], "points": ["resid_pre", "resid_mid", "resid_post", "z", "attn_out", "mlp_out"]},
            "max_response_bytes": {"tokens": [[5] * 100] * 4, "points": ["logits", "mlp_post"]},
            "max_request_bytes": {"tokens": [row], "points": ["resid_post.0"], "edits": {
                "resid_post.0": {"kind": "add", "vector": {"shape": [20000], "data": "AAAA" * 20000}}}}}
    for limit, body in asks.items():
        status, _, answer = raw_http(service, "POST", "/capture", body)
        assert status == 413, limit
        assert json.loads(answer)["error"] == "LimitExceeded" and f"{limit}=" in json.loads(answer)["message"]
    status, _, answer = raw_http(service, "POST", "/generate", {"tokens": [row], "points": ["logits"], "max_tokens": 33})
    assert status == 413 and "max_new_tokens=32" in json.loads(answer)["message"]
    with pytest.raises(LimitExceeded, match="max_points=16"):
        run_with_cache(model, torch.tensor([row]), ["resid_pre", "resid_mid", "resid_post", "z", "attn_out", "mlp_out"])


def test_every_socket_binds_loopback(service):
    """Every listening socket of this Ray (GCS, raylet, workers, Serve's controller, proxy and
    replicas, the replicas' inter-deployment gRPC servers included) is on loopback; the proxy
    serves the URL's port."""
    rows = ray_exposure.listening(ray_exposure.tree([os.getpid()]))
    assert rows and all(ray_exposure.is_loopback(ip) for ip, _, _ in rows), rows
    pids = {connect(NAME).transport.call("describe")["pid"] for _ in range(20)}
    assert len(pids) == 2
    replica_ports = [port for ip, port, _ in ray_exposure.listening(pids)]
    assert len(replica_ports) >= 4, replica_ports  # each: its core worker and Serve's gRPC server
    assert int(service.url.split(":")[2].split("/")[0]) in {port for _, port, _ in rows}


def test_a_replica_killed_under_load_loses_no_request(service, eager_models):
    """SIGKILL one replica once 8 of 64 generations (from Ray and HTTP clients) are done: Serve
    starts a new one, the clients send what was lost again (they did: ``resent``), and every
    caller gets the right answer."""
    import signal

    from interp_engine import capture_generation

    eager = eager_models("llama")
    prompts = [eager.to_tokens(p) for p in service_client.PROMPTS]
    want = [capture_generation(eager, t, ["resid_post.2"], max_tokens=16, stop_at_eos=False) for t in prompts]
    clients = [connect(NAME), connect(service.url, token=service.token)]
    victim = clients[0].transport.call("describe")["pid"]

    def one(i):
        return capture_generation(clients[i % 2], prompts[i % 6], ["resid_post.2"], max_tokens=16, stop_at_eos=False)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(64)]
        done = 0
        for _ in concurrent.futures.as_completed(futures):
            done += 1
            if done == 8:
                os.kill(victim, signal.SIGKILL)
        got = [f.result() for f in futures]
    assert sum(c.transport.resent for c in clients) >= 1  # the kill did cost requests, which were sent again
    for i, (completion, cache) in enumerate(got):
        assert completion.token_ids == want[i % 6][0].token_ids
        assert_near(cache["resid_post.2"], want[i % 6][1]["resid_post.2"], f"request {i}")
    deadline = time.monotonic() + 300  # a new replica starts a worker and loads the model: slow under load
    while clients[0].status()["replicas"] != {"RUNNING": 2} and time.monotonic() < deadline:
        time.sleep(1)
    pids = {clients[0].transport.call("describe")["pid"] for _ in range(20)}
    assert clients[0].status()["replicas"] == {"RUNNING": 2} and victim not in pids


def test_a_full_queue_answers_503_and_clients_back_off(cluster, tiny_path, eager_models):
    """One replica taking one request at a time with a queue of one: a burst of raw requests gets
    503 with Retry-After; the Ray and HTTP clients wait and send again, and all their calls succeed."""
    from interp_engine import capture_generation

    info = serve(str(tiny_path("llama")), name="tiny-queue", replicas=1, max_ongoing_requests=1,
                 max_queued_requests=1, **REPLICA)
    try:
        eager = eager_models("llama")
        body = {"tokens": eager.to_tokens("Hello").tolist(), "points": ["resid_post.2"], "max_tokens": 40,
                "stop_at_eos": False}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: raw_http(info, "POST", "/generate", body), range(8)))
        busy = [headers for status, headers, _ in answers if status == 503]
        assert busy and all(h["Retry-After"] == "1" for h in busy)
        assert {status for status, _, _ in answers} == {200, 503}
        _, want = capture_generation(eager, eager.to_tokens("Hello"), ["resid_post.2"], max_tokens=40, stop_at_eos=False)
        for model in (connect("tiny-queue"), connect(info.url, token=info.token)):
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                got = list(pool.map(lambda _: capture_generation(model, eager.to_tokens("Hello"), ["resid_post.2"],
                                                                 max_tokens=40, stop_at_eos=False)[1], range(6)))
            for cache in got:
                assert_near(cache["resid_post.2"], want["resid_post.2"], "generation under back-pressure")
    finally:
        shutdown("tiny-queue")


def test_a_model_that_cannot_load_fails_serve_with_its_error(cluster, tmp_path):
    started = time.monotonic()
    with pytest.raises(ServiceError, match=r"ModelNotFound: .*no such folder"):
        serve(str(tmp_path / "missing"), name="missing", **REPLICA)
    assert time.monotonic() - started < 120
    with pytest.raises(ServiceError, match="no service 'missing'"):
        connect("missing")


def test_the_serve_config_file_builds_a_working_service(service, tiny_path):
    """cluster/service.yaml validates as a Serve config, and its builder, given the file's own args
    (the model swapped for the tiny one), deploys a service that answers with the token it wrote."""
    import yaml
    from ray import serve as ray_serve
    from ray.serve.schema import ServeDeploySchema

    from interp_engine.service.app import build
    from interp_engine.service.auth import token_path

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "cluster/service.yaml").read_text()))
    assert config.http_options.host == "127.0.0.1" and config.proxy_location == "HeadOnly"
    (app,) = config.applications
    assert app.import_path == "interp_engine.service.app:build" and app.args["name"] == app.name
    args = {**app.args, "name": "from-config", "model": str(tiny_path("llama")), "replicas": 1, "cpus_per_replica": 0.5}
    ray_serve.run(build(args), name="from-config", route_prefix="/from-config")
    try:
        token = token_path("from-config").read_text()
        assert token_path("from-config").stat().st_mode & 0o777 == 0o600
        model = connect(service.url.replace(NAME, "from-config"), token=token)
        assert model.service["limits"]["max_prompts"] == app.args["limits"]["max_prompts"]
        assert model.n_layers == 3 and model.status()["replicas"] == {"RUNNING": 1}
    finally:
        shutdown("from-config")
