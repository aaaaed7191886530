"""What ``model.status()`` and ``interp-engine status`` show: each service's replicas, their
health and queue lengths, read from Serve (its application and deployment status) and from the
replicas themselves (:func:`.compat.ongoing_requests`). Runs in any process connected to the cluster."""

from __future__ import annotations

#: the deployment's name inside each service's Serve application
DEPLOYMENT = "CaptureReplica"


def service_status(name: str) -> dict:
    """One service: ``status`` (Serve's application status: RUNNING, DEPLOYING, DEPLOY_FAILED, ...),
    ``health`` (the deployment's: HEALTHY, UNHEALTHY, UPDATING, ...), ``replicas`` (how many in each
    state), ``queue`` (requests each running replica holds), ``dictionaries`` (what each replica
    holds of its clients' dictionaries: count, bytes, bound, dropped), ``message``, and the
    service's ``url``, ``model`` and ``backend`` (as a running replica describes them; None while
    none answers)."""
    from ray import serve

    from ..errors import ServiceError
    from . import compat

    apps = serve.status().applications
    if name not in apps:
        raise ServiceError(f"no service {name!r} on this cluster; running: {', '.join(sorted(apps)) or 'none'}")
    app = apps[name]
    deployments = list(app.deployments.values())
    deployment = deployments[0] if deployments else None
    queue = compat.ongoing_requests(name)
    facts = _facts(name) if app.status == "RUNNING" or getattr(app.status, "value", None) == "RUNNING" else {}
    return {"name": name, **{key: facts.get(key) for key in ("url", "model", "backend")},
            "status": str(app.status.value if hasattr(app.status, "value") else app.status),
            "health": None if deployment is None else str(getattr(deployment.status, "value", deployment.status)),
            "replicas": {} if deployment is None else dict(deployment.replica_states),
            "queue": queue, "queued": sum(n for n in queue.values() if n),
            "dictionaries": {k: v and v.get("dictionaries") for k, v in compat.replica_stats(name).items()},
            "message": app.message or (deployment.message if deployment else "")}


def _facts(name: str, timeout_s: float = 5.0) -> dict:
    """The service's own facts (url, model, backend, ...) as one of its replicas describes them;
    empty when none answers within ``timeout_s`` (a status never waits long on a busy service)."""
    from ray import serve

    try:
        return serve.get_app_handle(name).describe.remote().result(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - a status shows what it can; the replicas' states say why
        return {}


def all_status() -> list[dict]:
    """:func:`service_status` of every service on the cluster (Serve applications whose deployment is ours)."""
    from ray import serve

    apps = serve.status().applications
    return [service_status(name) for name, app in sorted(apps.items()) if DEPLOYMENT in app.deployments]
