"""What a running Ray exposes: the sockets its processes listen on, and which HTTP paths on them
answer a request that carries no token. Used by ``tests/cluster/test_security.py`` on the library's own
local Ray and on the ``cluster/local_cluster.py`` cluster, and compared there with the list that
docs/CLUSTER.md documents (:func:`documented`).
"""

from __future__ import annotations

import http.client
import ipaddress
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: paths asked of every HTTP port: everything Ray 2.60 lets through without the token, and
#: protected ones (jobs, state API, versions, the static tree, cluster status)
PROBE_PATHS = ("/", "/favicon.ico", "/static/index.js", "/metrics", "/api/authentication_mode", "/api/authenticate",
               "/api/healthz", "/api/gcs_healthz", "/api/local_raylet_healthz", "/-/healthz", "/api/jobs/",
               "/api/version", "/api/v0/tasks", "/api/cluster_status", "/nodes", "/logical/actors")
EVERY_PATH = "every path"


def role(process) -> str:
    """A Ray process by what it is: ``gcs_server``, ``raylet``, ``DashboardAgent``,
    ``RuntimeEnvAgent``, ``worker`` (``ray::IDLE`` and every actor or task), or the Python script
    it runs (``dashboard.py``, ``monitor.py``, ``ray.util.client.server`` ...)."""
    name = process.name()
    if name in ("raylet", "gcs_server"):
        return name
    if name.startswith("ray::"):
        name = name[5:]
        return name if name in ("DashboardAgent", "RuntimeEnvAgent") else "worker"
    command = process.cmdline()
    for i, arg in enumerate(command):
        if arg == "-m" and i + 1 < len(command):
            return command[i + 1]
        if not arg.startswith("-") and (arg.endswith(".py") or arg.endswith("/ray")):
            return Path(arg).name
    return name


def tree(pids) -> set[int]:
    """``pids`` and all their descendants."""
    import psutil

    found = set()
    for pid in pids:
        try:
            process = psutil.Process(pid)
            found |= {pid, *(child.pid for child in process.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    return found


def listening(pids) -> list[tuple[str, int, str]]:
    """(address, port, role) of every TCP socket that a process of ``pids`` listens on."""
    import psutil

    rows = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                rows.append((conn.laddr.ip, conn.laddr.port, role(psutil.Process(conn.pid))))
            except psutil.NoSuchProcess:
                pass
    return sorted(rows)


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback


def get(port: int, path: str, token: str | None = None, timeout: float = 5) -> tuple[int, bytes] | None:
    """(status, first bytes of the body) of ``GET path`` on 127.0.0.1:port, or None when the port
    does not speak HTTP/1.1 (the gRPC servers)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = connection.getresponse()
        return response.status, response.read(200)
    except (http.client.HTTPException, OSError):
        return None
    finally:
        connection.close()


def kind(port: int) -> str | None:
    """``Prometheus`` for a metrics server (it answers every path with metrics text), ``HTTP``
    for another HTTP server, None for a port that does not speak HTTP/1.1."""
    first = get(port, "/metrics")
    if first is None:
        return None
    return "Prometheus" if first[0] == 200 and first[1].startswith(b"# HELP") else "HTTP"


def without_token(rows) -> dict[tuple[str, str], set[str]]:
    """For each HTTP port of ``rows`` (:func:`listening`), keyed by (role, kind), the probe paths
    that a request without the token gets past authentication on (any answer but 401/403).
    ``kind`` is :func:`kind`; a Prometheus server that answers every probe path gets
    ``{EVERY_PATH}``. Roles with more than one such port (one per node) merge."""
    found: dict[tuple[str, str], set[str]] = {}
    for _, port, name in rows:
        server = kind(port)
        if server is None:
            continue
        answered = {path for path in PROBE_PATHS if (got := get(port, path)) is not None and got[0] not in (401, 403)}
        if server == "Prometheus" and answered == set(PROBE_PATHS):
            answered = {EVERY_PATH}
        found.setdefault((name, server), set()).update(answered)
    return found


def documented(doc: Path = ROOT / "docs" / "CLUSTER.md") -> dict[tuple[str, str], set[str]]:
    """The table under "Reachable without the token" in docs/CLUSTER.md, as (role, kind) -> the
    paths it names (backquoted; ``/static/...`` stands for the probe path under /static/)."""
    text = doc.read_text()
    start = text.index("**Reachable without the token.**")
    table = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    rows = {}
    for line in table[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        process, kind, paths = re.findall(r"`([^`]+)`", cells[1])[0], cells[2], cells[3]
        named = {EVERY_PATH} if paths.startswith(EVERY_PATH) else set(re.findall(r"`(/[^`]*)`", paths))
        rows[(process, kind)] = {("/static/index.js" if p == "/static/..." else p) for p in named}
    return rows
