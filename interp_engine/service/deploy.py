"""Deploying a model as a service: ``serve(...)`` and ``shutdown(name)``.

``serve`` joins the Ray cluster the caller connected to (``ray.init`` or ``RAY_ADDRESS``) or starts
the library's own loopback Ray (:mod:`interp_engine.loopback`), starts Ray Serve there if it is not
running yet (its HTTP proxy on the head node, on 127.0.0.1 unless ``host=`` says otherwise), and
deploys one Serve application per model, named ``name`` and routed at ``/name``: a deployment of
:class:`~.replica.CaptureReplica` replicas, each loading the model once. It returns when every
replica has loaded the model and answered, or raises the replica's own error (a model that
cannot load fails ``serve()``, it does not hang).

The application lives in Serve, not in the calling process: on a cluster the caller did not
start, it outlives the caller until ``shutdown(name)``. (A Ray that ``serve`` started itself
lives as long as the calling process; ``interp-engine serve`` keeps its process for that.)
"""

from __future__ import annotations

import dataclasses
import secrets
import time

from ..errors import InputError, ServiceError
from .auth import new_token, token_sha256, write_token
from .limits import Limits

from .http_guard import MAX_ONGOING, MAX_QUEUED


@dataclasses.dataclass(frozen=True)
class ServiceInfo:
    """What ``serve`` returns: the service's name, its HTTP address, and the bearer token HTTP
    clients send (kept out of ``repr``; also stored in ``token_path``, readable by you only)."""

    name: str
    url: str
    token: str = dataclasses.field(repr=False)
    token_path: str = ""
    model: str = ""
    backend: str = ""
    replicas: int = 1


def serve(model: str, name: str, *, backend: str = "eager", replicas: int = 1, min_replicas: int | None = None,
          max_replicas: int | None = None, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          dtype="float32", device: str | None = None, gpus_per_replica: float | None = None,
          cpus_per_replica: float = 1, torch_threads: int | None = None, env_vars: dict[str, str] | None = None,
          max_ongoing_requests: int = MAX_ONGOING, max_queued_requests: int = MAX_QUEUED,
          startup_timeout: float = 600, replace: bool = False, **backend_options) -> ServiceInfo:
    """Deploy ``model`` as the service ``name`` (see the module docstring) and return its :class:`ServiceInfo`.

    ``replicas`` copies of the model, or between ``min_replicas`` and ``max_replicas`` scaled by
    queue length (Serve's autoscaler). ``host`` / ``port``: where Serve's HTTP proxy listens when
    this call starts Serve (127.0.0.1: this machine only). ``limits``: what one HTTP request may
    ask for (:class:`~.limits.Limits`). Placement (``gpus_per_replica``, ``cpus_per_replica``,
    ``torch_threads``, ``env_vars``) and other keyword arguments are those of
    ``load_model(..., replicas=N)``. A name that already runs is refused unless ``replace=True``
    (then its connected Ray clients fail with ``ServiceChanged`` instead of getting the new model's
    answers, and its HTTP clients need the new token).
    """
    from ray import serve as ray_serve

    from ..cluster.placement import connect
    from .app import application, scaling_of
    from .status import DEPLOYMENT

    _check_name(name)
    scaling = scaling_of(replicas, min_replicas, max_replicas)
    limits = limits or Limits()
    connect()
    url = _start_serve(host, port) + f"/{name}"
    if not replace:
        _check_free(name)
    token = new_token()
    deploy_id = secrets.token_hex(8)
    bound, count = application(model, name, url, token_sha256(token), backend=backend, scaling=scaling, limits=limits,
                               dtype=dtype, device=device, gpus_per_replica=gpus_per_replica,
                               cpus_per_replica=cpus_per_replica, torch_threads=torch_threads, env_vars=env_vars,
                               max_ongoing_requests=max_ongoing_requests, max_queued_requests=max_queued_requests,
                               deploy_id=deploy_id, **backend_options)
    started = time.monotonic()
    try:
        ray_serve.run(bound, name=name, route_prefix=f"/{name}", blocking=False)
    except RuntimeError as err:
        why = _replica_error(name, err)
        _forget(name)
        raise ServiceError(f"service {name!r} failed to start {model!r} ({backend}): {why}") from None
    handle = ray_serve.get_deployment_handle(DEPLOYMENT, app_name=name)
    handle.ping.remote().result(timeout_s=max(1.0, startup_timeout - (time.monotonic() - started)))
    if replace:
        _wait_replaced(name, handle, deploy_id, started + startup_timeout)
    path = write_token(name, token, url)
    return ServiceInfo(name, url, token, str(path), str(model), backend, count)


def shutdown(name: str) -> None:
    """Delete the service ``name`` (its replicas and route) and its token file. Serve itself keeps
    running for other services. Unknown names are an error that lists the running services."""
    from ray import serve as ray_serve

    from ..cluster.placement import connect
    from .auth import forget_token

    connect()
    running = ray_serve.status().applications
    if name not in running:
        raise ServiceError(f"no service {name!r} to shut down; running: {', '.join(sorted(running)) or 'none'}")
    ray_serve.delete(name)
    forget_token(name)


def _check_free(name: str) -> None:
    """Refuse to deploy over a running service: its clients would silently get another model."""
    from ray import serve as ray_serve

    app = ray_serve.status().applications.get(name)
    if app is not None:
        raise ServiceError(f"a service {name!r} already runs ({getattr(app.status, 'value', app.status)}): end it "
                           f"first (shutdown({name!r}) or interp-engine shutdown {name}), pick another name, or "
                           f"replace it with serve(..., replace=True) (interp-engine serve --replace); its "
                           f"connected clients then fail with ServiceChanged")


def _wait_replaced(name: str, handle, deploy_id: str, deadline: float) -> None:
    """Wait until Serve finished replacing the service ``name`` by the deployment ``deploy_id``
    (the application RUNNING again and answering as it), or raise its error."""
    from ray import serve as ray_serve

    while True:
        app = ray_serve.status().applications.get(name)
        state = "GONE" if app is None else str(getattr(app.status, "value", app.status))
        if state == "DEPLOY_FAILED":
            raise ServiceError(f"service {name!r} failed to replace its model: {_replica_error(name, RuntimeError(state))}")
        if state == "RUNNING":
            left = max(1.0, deadline - time.monotonic())
            if handle.identity.remote().result(timeout_s=left)["deploy_id"] == deploy_id:
                return
        if time.monotonic() > deadline:
            raise ServiceError(f"service {name!r} was not replaced within startup_timeout (state {state}); "
                               f"interp-engine status {name} shows why")
        time.sleep(0.5)


def _check_name(name) -> None:
    import re

    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise InputError(f"a service name must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter or "
                         f"digit): it becomes the URL path /NAME; got {name!r}")


def _start_serve(host: str, port: int) -> str:
    """Start Serve (HTTP proxy on the head node at ``host:port``) unless it runs; its base URL."""
    from ray import serve as ray_serve
    from ray.serve.context import _get_global_client

    try:
        client = _get_global_client(raise_if_no_controller_running=True)
    except Exception:
        client = None
    if client is None:
        _check_port(host, port)
        ray_serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
        client = _get_global_client()
    config = client.http_config
    shown = "127.0.0.1" if config.host in ("127.0.0.1", "localhost") else config.host
    return f"http://{shown}:{config.port}"


def _check_port(host: str, port: int) -> None:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ServiceError(f"cannot start Serve's HTTP proxy on {host}:{port}: {err.strerror}. Pass another "
                               f"port: serve(..., port=N)") from None


def _replica_error(name: str, err: BaseException) -> str:
    """The replica's own error (``Class: message``, the last line of its traceback), which Serve keeps
    in the deployment's status message; Serve's own summary where there is none."""
    from ray import serve as ray_serve

    texts = [str(err)]
    try:
        app = ray_serve.status().applications.get(name)
        texts = [d.message for d in app.deployments.values()] + [app.message] + texts
    except Exception:
        pass
    for text in texts:
        tail = text.rsplit("Traceback (most recent call last):", 1)[-1]
        lines = [line for line in tail.splitlines() if line.strip() and not line[0].isspace() and ": " in line]
        if lines and "Traceback" in text:
            kind, _, message = lines[-1].partition(": ")
            return f"{kind.rsplit('.', 1)[-1]}: {message}"
    return texts[-1]


def _forget(name: str) -> None:
    from ray import serve as ray_serve

    try:
        ray_serve.delete(name)
    except Exception:
        pass
