"""The HTTP API's body guards, at the socket: a body marked as carrying dictionaries is refused by
``Limits.max_dictionary_bytes`` from its Content-Length alone (nothing of it is read), and a POST
without a Content-Length (a chunked body, which could slip past that check) is refused with 411."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from .served import LIMITS

pytest.importorskip("ray")
BODY = json.dumps({"tokens": [[1, 2, 3]], "points": ["resid_post.0"]}).encode()


def _post(service, headers: dict, body: bytes = b"") -> tuple[int, dict]:
    """Status and JSON answer of a POST /capture written to the socket as given."""
    host, port = service.url.split("//")[1].split("/")[0].split(":")
    head = {"Host": f"{host}:{port}", "Authorization": f"Bearer {service.token}", "Content-Type": "application/json",
            **headers}
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        lines = [f"POST /{service.name}/capture HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items()]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        data = response.read()
    return response.status, (json.loads(data) if response.getheader("Content-Type", "").startswith("application/json")
                             else {})


def test_dictionaries_over_max_dictionary_bytes_are_refused_unread(service):
    size = LIMITS.max_request_bytes + LIMITS.max_dictionary_bytes + 1  # ~1 GiB announced, never sent
    status, answer = _post(service, {"Content-Length": size, "X-Interp-Engine-Dictionaries": "1"})
    assert status == 413 and answer["error"] == "LimitExceeded"
    assert "max_dictionary_bytes" in answer["message"] and "send smaller dictionaries" in answer["message"]


def test_a_post_without_content_length_gets_411(service):
    chunked = f"{len(BODY):x}\r\n".encode() + BODY + b"\r\n0\r\n\r\n"
    status, answer = _post(service, {"Transfer-Encoding": "chunked"}, chunked)
    assert status == 411 and answer["error"] == "InputError" and "Content-Length" in answer["message"]
    status, _ = _post(service, {"Content-Length": len(BODY)}, BODY)
    assert status == 200  # the same body with its length is served
