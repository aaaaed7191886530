"""What the eager-service test modules share: the deployment's name and limits, where the
replicas run, and raw HTTP requests to it (tests/service/eager/conftest.py deploys it once)."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

from interp_engine import Limits

ROOT = Path(__file__).resolve().parents[3]
NAME = "tiny-llama"
#: small enough to hit in a test, large enough for the catalogue of tests/service/service_client.py;
#: dictionary memory for the pair test_service_features.py attaches at once (790,528 bytes), not for
#: two of test_hostile_http.py's larger ones (790,016 bytes each)
LIMITS = Limits(max_prompts=8, max_tokens=512, max_points=16, max_new_tokens=32, max_response_bytes=2**20,
                max_request_bytes=2**16, max_dictionary_memory_bytes=10**6, upload_grace_s=10)
REPLICA = dict(cpus_per_replica=0.5, torch_threads=1)


def raw_http(info, method: str, path: str, body=None, token: str | None = "own", headers: dict | None = None):
    """(status, headers, body) of one raw HTTP request to the service."""
    host, port = info.url.split("//")[1].split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {info.token if token == 'own' else token}"
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        sent["Content-Type"] = "application/json"
    connection.request(method, f"/{info.name}{path}", body=data, headers=sent)
    response = connection.getresponse()
    return response.status, response.headers, response.read()
