"""The clients' back-off, observed (no cluster): a request refused for load or lost is sent again
after the service's ``Retry-After``, else after a delay that doubles from 0.1 s up to 5 s, until the
retry deadline, when the client gives up with a ServiceError that says how often it tried. A fake
HTTP service on 127.0.0.1 answers, and a stubbed clock records each wait instead of sleeping."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from interp_engine.errors import InputError, ServiceError
from interp_engine.service import transport


class Clock:
    """``time.monotonic`` and ``time.sleep`` of the transport module: sleeping advances the clock."""

    def __init__(self):
        self.now, self.slept = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(transport.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(transport.time, "sleep", fake.sleep)
    return fake


@pytest.fixture
def service():
    """A fake service: each request takes the next answer from ``answers`` (status, headers, body)."""
    answers, seen = [], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            status, headers, body = answers.pop(0)
            data = json.dumps(body).encode()
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/svc", answers, seen
    server.shutdown()
    server.server_close()


def test_retry_after_is_obeyed_then_the_request_succeeds(clock, service):
    url, answers, seen = service
    answers += [(503, {"Retry-After": "1"}, {"detail": "busy"}), (503, {"Retry-After": "3"}, {"detail": "busy"}),
                (200, {}, {"ok": True})]
    http_client = transport.HttpTransport(url, token="t")
    assert json.loads(http_client.request("GET", "/ping")) == {"ok": True}
    assert clock.slept == [1.0, 3.0] and http_client.resent == 2 and seen == ["/svc/ping"] * 3


def test_without_retry_after_the_delay_doubles_up_to_its_cap(clock, service):
    url, answers, _ = service
    answers += [(503, {}, {"detail": "busy"})] * 9 + [(502, {}, "bad gateway"), (200, {}, {"ok": 1})]
    http_client = transport.HttpTransport(url, token="t")
    assert json.loads(http_client.request("GET", "/ping")) == {"ok": 1}
    assert clock.slept == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0, 5.0])


def test_past_the_deadline_the_client_gives_up_saying_so(clock, service):
    url, answers, _ = service
    answers += [(503, {"Retry-After": "7"}, {"detail": "busy"})] * 100
    http_client = transport.HttpTransport(url, token="t", retry_timeout=30)
    with pytest.raises(ServiceError, match=r"GET .*/svc/ping failed 5 times .* last: HTTP 503") as err:
        http_client.request("GET", "/ping")
    assert clock.slept == [7.0] * 4 and sum(clock.slept) <= 30  # a fifth wait would pass the deadline
    assert "interp-engine status" in str(err.value)


def test_a_refusal_of_the_request_itself_is_not_retried(clock, service):
    url, answers, _ = service
    answers += [(400, {}, {"error": "InputError", "message": "bad points"})]
    with pytest.raises(InputError, match="bad points"):
        transport.HttpTransport(url, token="t").request("GET", "/ping")
    assert clock.slept == []


def test_the_default_deadline_is_the_documented_300_s(clock):
    retry = transport.Retry("a capture")
    lost = transport.Lost("replica lost", retry_after=60.0)
    assert [retry.delay(lost) for _ in range(4)] == [60.0] * 4 and clock.now == 1000.0  # delay() only computes
    clock.now += 240
    assert retry.delay(lost) == 60.0  # ends exactly at the deadline: still allowed
    clock.now += 1  # 60 s more would end 1 s after the 300 s deadline
    with pytest.raises(ServiceError, match="failed 6 times over 241s"):
        retry.delay(lost)
