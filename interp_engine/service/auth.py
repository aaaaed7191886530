"""The service's bearer token: made at deploy time, kept in a file only its owner can read, and
checked by the replicas against its SHA-256 (they never hold the token itself).

The token is 32 random bytes (``secrets.token_urlsafe``). :func:`write_token` creates
``<cache>/service/<name>.token`` with mode 0600 in a 0700 folder (``$INTERP_ENGINE_CACHE``,
default ``~/.cache/interp_engine``); :func:`token_sha256` is what the deployment is given. A
request's token is compared in constant time (:func:`matches`): its SHA-256 against the
expected one with :func:`hmac.compare_digest`, so neither the length nor a prefix of the token
leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from ..embedded import cache_dir
from ..errors import ServiceError


def token_dir() -> Path:
    return cache_dir() / "service"


def token_path(name: str) -> Path:
    return token_dir() / f"{name}.token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def matches(presented: str, expected_sha256: str) -> bool:
    """Whether ``presented`` is the token whose SHA-256 is ``expected_sha256`` (constant time)."""
    return hmac.compare_digest(token_sha256(presented), expected_sha256)


def write_token(name: str, token: str) -> Path:
    """Write ``token`` to :func:`token_path` (replacing an older one), readable by this user only."""
    folder = token_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_mode & 0o077:
        folder.chmod(0o700)
    path = token_path(name)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(token)
    os.replace(temp, path)
    return path


def read_token(name: str) -> str:
    """The token :func:`write_token` stored for ``name``; a clear error when there is none."""
    path = token_path(name)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ServiceError(f"no token for service {name!r} at {path}: pass token=... (serve() returned it as "
                           f"info.token, and wrote it where it ran: {token_path('NAME')})") from None
