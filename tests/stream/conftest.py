"""Fixtures shared by the stream tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def llama(eager_models):
    """The shared tiny eager llama (built once per session; see tests/conftest.py)."""
    return eager_models("llama")
