"""Ray on loopback: how a Ray that this project starts itself keeps every socket on 127.0.0.1,
with token authentication. Two places start one: :func:`start_local_ray` (``load_model(...,
replicas=N)`` and ``jobs/build_dataset.py`` with no cluster connected) and
``cluster/local_cluster.py`` (a multi-node cluster on one machine); both take their loopback
settings from here.

Written against ray 2.60. Ray binds a node's servers (GCS, raylet, core workers, dashboard
agent, runtime-env agent, metrics) to loopback exactly when the node's address is loopback, and
to all interfaces or the machine's address otherwise. It resolves a requested node address of
``127.0.0.1`` to the machine's address unless its local-only switch is off: the constant
``ray_constants.ENABLE_RAY_CLUSTER``, read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ``ray``
is imported. ``ray start`` processes get the switch from their environment (:data:`LOOPBACK_ENV`);
a ``ray.init`` in a process that has already imported ``ray`` gets it by turning the constant
off for the duration of the call (the node's processes learn the address from their command
lines, so nothing else needs it).

Token authentication: Ray 2.60 turns it on for a new local Ray unless ``RAY_AUTH_MODE`` says
otherwise, and keeps the token in ``~/.ray/auth_token`` (or where ``RAY_AUTH_TOKEN`` /
``RAY_AUTH_TOKEN_PATH`` say). Ray writes that file with the default mode (0644 under the usual
umask); the token here is created 0600 in a 0700 folder instead, since with every port on
loopback the token file is what keeps other users of the machine out.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from .errors import LoopbackError

HOST = "127.0.0.1"
#: Ray's local-only switch, for ``ray start`` processes and clients of a loopback cluster
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def connect() -> None:
    """Join the cluster the user chose (``RAY_ADDRESS``), or start a local one with
    :func:`start_local_ray`. Does nothing when this process is already connected."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        start_local_ray()


def start_local_ray(**init_options) -> None:
    """Start a new single-node Ray in this process (``ray.init(address="local")``) whose every
    socket listens on 127.0.0.1 and which runs with token authentication. No dashboard;
    ``init_options`` go to ``ray.init``."""
    import ray
    from ray._private import ray_constants

    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.strip().lower() != "token":
        raise LoopbackError(
            f"RAY_AUTH_MODE={mode!r} is set, but the Ray that interp_engine starts itself always runs with token "
            f"authentication. Unset RAY_AUTH_MODE (or set it to 'token'), or start a Ray yourself "
            f"(ray.init(...) or RAY_ADDRESS) and the library joins it as it is.")
    _private_default_token()
    options = {"include_dashboard": False, "log_to_driver": False, **init_options}
    switch = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # keep 127.0.0.1 as the node's address (see the module doc)
    try:
        ray.init(address="local", _node_ip_address=HOST, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = switch
    if os.environ.get("RAY_AUTH_MODE") != "token":  # Ray sets it when it turns token auth on
        ray.shutdown()
        raise LoopbackError("the local Ray started without token authentication (ray changed its default?); "
                            "set RAY_AUTH_MODE=token and try again")


def _private_default_token() -> None:
    """Make Ray's default token file (``~/.ray/auth_token``) readable by this user only, creating
    it (with Ray's own format: 64 hex digits) when missing. A token the user chose through
    ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` is left as it is."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
