"""The service's bearer token: made at deploy time, kept in a file only its owner can read, and
checked by the replicas against its SHA-256 (they never hold the token itself).

The token is 32 random bytes (``secrets.token_urlsafe``). :func:`write_token` creates
``<cache>/service/<name>.token`` with mode 0600 in a 0700 folder (``$INTERP_ENGINE_CACHE``,
default ``~/.cache/interp_engine``); :func:`token_sha256` is what the deployment is given. A
request's token is compared in constant time (:func:`matches`): its SHA-256 against the
expected one with :func:`hmac.compare_digest`, so neither the length nor a prefix of the token
leaks through timing.

A token belongs to one URL. Beside the token (kept alone in its file, so ``$(cat NAME.token)``
stays a bearer header) :func:`write_token` records in ``NAME.origin`` the service's origin
(:func:`origin`: scheme, host, port and path) and the SHA-256 of the token it belongs to;
:func:`read_token` hands the token only to a URL of that origin, so ``connect(url)`` without
``token=`` never sends it to another host, port or path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import urllib.parse
from pathlib import Path

from ..embedded import cache_dir
from ..errors import InputError, ServiceError, TokenOriginError


def token_dir() -> Path:
    return cache_dir() / "service"


def token_path(name: str) -> Path:
    return token_dir() / f"{name}.token"


def origin_path(name: str) -> Path:
    return token_dir() / f"{name}.origin"


def origin(url: str) -> str:
    """``scheme://host:port/path`` of a service URL: the scheme and host lower-cased, the port
    explicit, no trailing slash. Two URLs reach the same service only if their origins are equal."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise InputError(f"a service URL looks like http://127.0.0.1:8000/NAME, got {url!r} ({err})") from None
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in ("http", "https") or not host:
        raise InputError(f"a service URL looks like http://127.0.0.1:8000/NAME, got {url!r}")
    port = port or (443 if scheme == "https" else 80)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}{parts.path.rstrip('/')}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def matches(presented: str, expected_sha256: str) -> bool:
    """Whether ``presented`` is the token whose SHA-256 is ``expected_sha256`` (constant time)."""
    return hmac.compare_digest(token_sha256(presented), expected_sha256)


def write_token(name: str, token: str, url: str) -> Path:
    """Write ``token`` to :func:`token_path` and the :func:`origin` of ``url`` it belongs to to
    :func:`origin_path` (replacing older ones), readable by this user only."""
    folder = token_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_mode & 0o077:
        folder.chmod(0o700)
    _write_private(origin_path(name), json.dumps({"origin": origin(url), "token_sha256": token_sha256(token)}))
    return _write_private(token_path(name), token)


def _write_private(path: Path, text: str) -> Path:
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(text)
    os.replace(temp, path)
    return path


def forget_token(name: str) -> None:
    """Remove the token and origin files of ``name`` (the service is gone)."""
    token_path(name).unlink(missing_ok=True)
    origin_path(name).unlink(missing_ok=True)


def read_token(url: str) -> str:
    """The token :func:`write_token` stored for the service at ``url`` (named by the URL's last path
    segment), only if it was stored for that very :func:`origin`; a clear error otherwise."""
    import re

    wanted = origin(url)
    name = wanted.rsplit("/", 1)[-1]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise InputError(f"a service URL ends with the service's name (http://127.0.0.1:8000/NAME), got {url!r}")
    path = token_path(name)
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise ServiceError(f"no token for service {name!r} at {path}: pass token=... (serve() returned it as "
                           f"info.token, and wrote it where it ran: {token_path('NAME')})") from None
    try:
        record = json.loads(origin_path(name).read_text())
        stored, belongs = record["origin"], record["token_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise TokenOriginError(f"the token in {path} records no URL it belongs to ({origin_path(name)} is missing "
                               f"or unreadable), so it is sent nowhere: pass token=... to connect({url!r}), or "
                               f"deploy the service again to store it with its URL") from None
    if not matches(token, belongs):
        raise TokenOriginError(f"{path} and {origin_path(name)} disagree (a deploy in progress?): the token is sent "
                               f"nowhere; connect again once serve() returned, or pass token=...")
    if stored != wanted:
        raise TokenOriginError(f"the token in {path} belongs to {stored}, not to {wanted}: it is only ever sent to "
                               f"the URL it was made for. To send a token to {url}, pass it: "
                               f"connect({url!r}, token=...)")
    return token
