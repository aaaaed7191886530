"""The service's client against whatever answers at a URL (issue 35): fake HTTP servers on
127.0.0.x, no Ray and no deployment. A server never chooses a path on the client, a stored token
goes only to the URL it was made for, ``timeout=`` bounds the whole ``connect``, and
``interp-engine serve`` leaves no token behind when it is stopped."""

from __future__ import annotations

import base64
import dataclasses
import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from interp_engine import ServiceError, TokenOriginError, UnsafeServiceAnswer, connect
from interp_engine.service.auth import origin_path, token_path, write_token
from interp_engine.service.identity import check, identity

ROOT = Path(__file__).resolve().parents[2]


def _plain(data: dict) -> dict:
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else list(v) if isinstance(v, tuple) else v
            for k, v in data.items()}


@pytest.fixture(scope="module")
def info_of(eager_models, tmp_path_factory):
    """``info_of(files)``: a ``GET /info`` answer as a real replica gives it for the tiny Llama, its
    tokenizer files replaced by ``files`` (name -> bytes; None: the model's own)."""
    eager = eager_models("llama")
    folder = tmp_path_factory.mktemp("tokenizer")
    eager.tok.hf.save_pretrained(folder)
    own = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    def build(files=None):
        return {"service": {"name": "svc", "url": "", "model": "tiny", "backend": "eager", "replicas": 1},
                "model": _plain(dataclasses.asdict(eager.info)),
                "capabilities": _plain(dataclasses.asdict(eager.capabilities)), "dtype": eager.dtype,
                "tokenizer_files": {k: base64.b64encode(v).decode() for k, v in (files or own).items()}}

    build.own = own
    return build


class FakeService:
    """An HTTP server on ``host``: answers ``GET .../info`` with ``info`` (or never, if ``silent``),
    and records every request's path and Authorization header."""

    def __init__(self, host: str = "127.0.0.1", info: dict | None = None, silent: bool = False,
                 declared: int | None = None):
        seen = self.seen = []
        release = self.release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append((self.path, self.headers.get("Authorization")))
                if silent:
                    release.wait(30)
                    return
                body = json.dumps(info or {}).encode()
                self.send_response(200 if self.path.endswith("/info") else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(declared or len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERP_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# -- a server never chooses a path --------------------------------------------------------------
def test_a_benign_fake_service_connects(info_of):
    """The oracle of the hostile cases below: the same fake service with the model's own tokenizer
    files connects, and tokenizes as the local model does."""
    fake = FakeService(info=info_of())
    try:
        model = connect(f"{fake.url}/svc", token="t0k", timeout=10)
        assert model.n_layers == 3 and model.to_tokens("Hello there").shape[1] > 1
        assert fake.seen == [("/svc/info", "Bearer t0k")]
    finally:
        fake.close()


@pytest.mark.parametrize("bad", ["../escaped.json", "ABSOLUTE", "sub/dir.json", "..", ".hidden", "a\x00b",
                                 "..\\escaped.json"])
def test_tokenizer_file_names_that_are_paths_are_refused(info_of, tmp_path, monkeypatch, bad):
    """A server that names a tokenizer file ``../x``, an absolute path, a folder, a dot file or a
    NUL is refused with the entry named, and nothing is written anywhere: not beside the client's
    temporary folder, not at the absolute path, not in it."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the client makes its temporary folder
    target = tmp_path / "absolute.json"
    name = str(target) if bad == "ABSOLUTE" else bad
    fake = FakeService(info=info_of({**info_of.own, name: b"{}"}))
    try:
        with pytest.raises(UnsafeServiceAnswer, match="not a plain file name") as refused:
            connect(f"{fake.url}/svc", token="t0k", timeout=10)
        assert repr(name)[:20] in str(refused.value)
        assert not target.exists() and not (tmp_path / "escaped.json").exists()
        assert list(temp.iterdir()) == []  # the temporary folder is gone and held nothing else
        assert sorted(p.name for p in tmp_path.iterdir()) == ["temp"]
    finally:
        fake.close()


@pytest.mark.parametrize("declared", [None, 10**12])
def test_a_server_does_not_choose_how_much_the_client_reads(info_of, monkeypatch, declared):
    """``GET /info`` is read up to a bound (here lowered below the real answer's size): a longer
    answer, or one that declares 1 TB, is refused at once (nothing more read, no retry)."""
    from interp_engine.service import transport

    info = info_of()
    monkeypatch.setattr(transport, "MAX_INFO_BYTES", len(json.dumps(info)) - 1)
    fake = FakeService(info=info, declared=declared)
    try:
        started = time.monotonic()
        with pytest.raises(UnsafeServiceAnswer, match=r"/svc/info answered more than \d+ bytes"):
            connect(f"{fake.url}/svc", token="t0k", timeout=20)
        assert len(fake.seen) == 1 and time.monotonic() - started < 10
    finally:
        fake.close()


# -- a stored token goes only to its own URL ----------------------------------------------------
def test_a_stored_token_is_sent_only_to_the_url_it_was_made_for(info_of, cache):
    """serve() stored a token for http://127.0.0.1:PORT/svc. connect() without token= sends it
    there, and to no other host, port or path: those are refused before any request, naming the
    URL the token belongs to and how to pass one; fake servers at them receive nothing."""
    home = FakeService(info=info_of())
    others = [FakeService("127.0.0.2", info=info_of()), FakeService(info=info_of())]
    try:
        write_token("svc", "the-secret", f"{home.url}/svc")
        for url in [f"{others[0].url}/svc", f"{others[1].url}/svc", f"{home.url}/prefix/svc",
                    f"{home.url.replace('http://', 'https://')}/svc"]:
            with pytest.raises(TokenOriginError, match=rf"belongs to {home.url}/svc, not to .*token=") as err:
                connect(url, timeout=10)
            assert "the-secret" not in str(err.value)
        assert [server.seen for server in others] == [[], []] and home.seen == []
        connect(f"{home.url}/svc/", timeout=10)  # its own URL (a trailing slash is the same URL)
        assert home.seen == [("/svc/info", "Bearer the-secret")]
        connect(f"{others[0].url}/svc", token="given", timeout=10)  # token= is sent where it is told to go
        assert others[0].seen == [("/svc/info", "Bearer given")]
    finally:
        for server in [home, *others]:
            server.close()


def test_a_token_without_its_url_is_sent_nowhere(info_of, cache):
    """A token file without its origin record (an older version's, or one written by hand), or with
    an origin record for another token, is not sent: the error says why and how to pass one."""
    fake = FakeService(info=info_of())
    try:
        write_token("svc", "the-secret", f"{fake.url}/svc")
        origin_path("svc").unlink()
        with pytest.raises(TokenOriginError, match="records no URL.*token="):
            connect(f"{fake.url}/svc", timeout=10)
        write_token("svc", "old", f"{fake.url}/svc")
        token_path("svc").write_text("the-secret")  # the token replaced, its record not
        with pytest.raises(TokenOriginError, match="disagree"):
            connect(f"{fake.url}/svc", timeout=10)
        assert fake.seen == []
    finally:
        fake.close()


# -- timeout= bounds the whole connect ----------------------------------------------------------
@pytest.mark.parametrize("where", ["refused", "silent"])
def test_timeout_bounds_the_whole_connect(where):
    """A refused connection (port 1) is retried, and a server that accepts but never answers is
    waited for, only until ``timeout`` passes: connect() fails within it (plus a generous margin
    for a loaded machine), where it used to retry for 300 s."""
    fake = FakeService(silent=True) if where == "silent" else None
    url = f"{fake.url}/svc" if fake else "http://127.0.0.1:1/svc"
    try:
        started = time.monotonic()
        with pytest.raises(ServiceError, match="failed"):
            connect(url, token="t0k", timeout=2)
        assert time.monotonic() - started < 2 + 10
    finally:
        if fake:
            fake.close()


# -- the deployment's identity ------------------------------------------------------------------
def test_a_changed_deployment_is_named():
    """check() passes the deployment a client connected to and names every field that changed."""
    old = identity({"deploy_id": "a1", "model": "/m/llama", "backend": "eager"}, "float32", "f" * 64)
    check(old, dict(old), "svc")
    new = identity({"deploy_id": "b2", "model": "/m/qwen2", "backend": "eager"}, "float32", "e" * 64)
    with pytest.raises(ServiceError, match=r"'svc' was redeployed .*deploy_id 'a1' -> 'b2'; model '/m/llama' -> "
                                           r"'/m/qwen2'; weights_sha256 .*connect\('svc'\)") as err:
        check(old, new, "svc")
    assert "backend" not in str(err.value) and "dtype" not in str(err.value)
    with pytest.raises(ServiceError, match="named no deployment"):
        check(None, new, "svc")


# -- interp-engine serve leaves no token behind -------------------------------------------------
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_stopping_interp_engine_serve_removes_its_token(tmp_path, how):
    """What `interp-engine serve` runs once its service is up (cli._hold), stopped with Ctrl-C or
    SIGTERM: the token and its origin record are gone."""
    env = {**os.environ, "INTERP_ENGINE_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = ("import signal, threading, time\n"
            "from interp_engine.service.auth import write_token\n"
            "from interp_engine.service.cli import _hold\n"
            "def ready():\n"  # 'up' once _hold handles SIGTERM: it is waiting
            "    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL: time.sleep(0.05)\n"
            "    print('up', flush=True)\n"
            "write_token('svc', 'the-secret', 'http://127.0.0.1:8000/svc')\n"
            "threading.Thread(target=ready, daemon=True).start()\n"
            "_hold('svc')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        assert (tmp_path / "service" / "svc.token").exists() and (tmp_path / "service" / "svc.origin").exists()
        time.sleep(0.2)  # into the wait
        proc.send_signal(how)
        assert proc.wait(timeout=60) == 0
        assert list((tmp_path / "service").iterdir()) == []
    finally:
        proc.kill()
        proc.wait()


# -- a Ray client's wait on a reply -------------------------------------------------------------
class _Never:
    """A DeploymentResponse that never resolves (a request to a service that is gone), or raises
    ``error`` at once."""

    def __init__(self, error: BaseException | None = None):
        self.error, self.waits, self.cancelled = error, 0, False

    def result(self, timeout_s):
        self.waits += 1
        if self.error is not None:
            raise self.error
        time.sleep(timeout_s)
        raise TimeoutError("Timed out resolving to ObjectRef.")

    def cancel(self):
        self.cancelled = True


def test_a_ray_client_waits_for_a_reply_only_until_its_deadline(monkeypatch):
    """RayTransport._result: a reply that never comes is an error at the deadline and is cancelled;
    a service found gone ends the wait at the next check; a replica's own TimeoutError (Ray's
    RayTaskError subclasses its cause) is raised, not taken for a slow reply."""
    pytest.importorskip("ray")
    from ray.exceptions import RayTaskError

    from interp_engine.service import ray_transport

    monkeypatch.setattr(ray_transport, "ALIVE_CHECK_S", 0.2)
    transport = object.__new__(ray_transport.RayTransport)
    transport.name, transport.timeout, checks = "svc", 1.0, []
    transport.check_alive = lambda: checks.append(1)
    response, started = _Never(), time.monotonic()
    with pytest.raises(ServiceError, match=r"no reply within 1s.*timeout="):
        transport._result(response, "run on service 'svc'", time.monotonic() + 1.0)
    assert response.cancelled and checks and time.monotonic() - started < 1.0 + 5

    def gone():
        raise ServiceError("service 'svc' is gone from this cluster")

    transport.check_alive = gone
    response = _Never()
    with pytest.raises(ServiceError, match="gone"):
        transport._result(response, "run", time.monotonic() + 60)
    assert response.cancelled and response.waits == 1

    try:
        raise TimeoutError("the replica's own")
    except TimeoutError as cause:
        own = RayTaskError("run", "traceback", cause).as_instanceof_cause()
    response = _Never(own)
    with pytest.raises(RayTaskError):
        transport._result(response, "run", time.monotonic() + 60)
    assert response.waits == 1


def test_interp_engine_serve_replaces_a_running_service_only_when_told(monkeypatch):
    """`interp-engine serve --replace` passes replace=True to serve(); without it, replace=False."""
    pytest.importorskip("ray")
    from interp_engine.service import cli, deploy

    asked = []

    def refuse(*args, **kwargs):
        asked.append(kwargs["replace"])
        raise ServiceError("a service 'x' already runs")

    monkeypatch.setattr(deploy, "serve", refuse)
    assert cli.main(["serve", "model", "--name", "x"]) == 1
    assert cli.main(["serve", "model", "--name", "x", "--replace"]) == 1
    assert asked == [False, True]
