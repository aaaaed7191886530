"""A new user's first hour with the HTTP client (issue 36), against a fake service (no Ray, no
deployment): ``connect()`` does not import the tokenizer library (most of a connect's time; the
tokenizer is built on first use), and the limits a service publishes are read, or refused when
malformed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from interp_engine import Limits, UnsafeServiceAnswer, connect

from .test_hostile_client import ROOT, FakeService, info_of  # noqa: F401  (info_of: a fixture)

CHILD = """
import sys, time
from interp_engine import connect
started = time.monotonic()
model = connect(sys.argv[1], token="t0k", timeout=30)
took = time.monotonic() - started
imported = "transformers" in sys.modules
ids = model.to_tokens("Hello there")[0].tolist()
print({"imported_at_connect": imported, "ids": ids, "connect_s": took})
"""


def test_connect_leaves_the_tokenizer_to_first_use(info_of, eager_models):
    """In a fresh process, ``connect`` returns without importing ``transformers``; ``to_tokens``
    then builds the service's tokenizer and tokenizes as the local model does."""
    fake = FakeService(info=info_of())
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, f"{fake.url}/svc"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
    finally:
        fake.close()
    assert out.returncode == 0, out.stderr[-3000:]
    result = eval(out.stdout.strip().splitlines()[-1])  # a dict literal this test's child printed
    assert result["imported_at_connect"] is False
    assert result["ids"] == eager_models("llama").to_tokens("Hello there")[0].tolist()


def test_a_service_publishes_its_limits_and_malformed_ones_are_refused(info_of):
    limits = Limits(max_prompts=3)
    for published, want in ((None, None), (json.loads(json.dumps(limits.__dict__)), limits)):
        info = info_of()
        if published is not None:
            info["service"]["limits"] = {**published, "a_later_limit": 7}  # a newer service's extra limit is ignored
        fake = FakeService(info=info)
        try:
            assert connect(f"{fake.url}/svc", token="t0k", timeout=10).limits == want
        finally:
            fake.close()
    info = info_of()
    info["service"]["limits"] = {"max_prompts": 0}
    fake = FakeService(info=info)
    try:
        with pytest.raises(UnsafeServiceAnswer, match="max_prompts must be a positive int"):
            connect(f"{fake.url}/svc", token="t0k", timeout=10)
    finally:
        fake.close()
