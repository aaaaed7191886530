"""A service as a Serve application: the one place that turns a model and its options into the
bound ``CaptureReplica`` deployment, for ``serve(...)`` and for ``serve deploy`` with a config file
(``cluster/service.yaml`` names :func:`build` as its ``import_path``).
"""

from __future__ import annotations

import dataclasses
import secrets

from ..errors import InputError
from ..scalars import integer
from .http_guard import MAX_ONGOING, MAX_QUEUED, RETRY_AFTER_S
from .limits import Limits



def application(model: str, name: str, url: str, token_sha256: str, *, backend: str = "eager", scaling: dict,
                limits: Limits, dtype="float32", device: str | None = None, gpus_per_replica: float | None = None,
                cpus_per_replica: float = 1, torch_threads: int | None = None, env_vars: dict | None = None,
                max_ongoing_requests: int = MAX_ONGOING, max_queued_requests: int = MAX_QUEUED,
                deploy_id: str | None = None, **backend_options):
    """The bound Serve application of one service, and its initial replica count. Runs where Ray is
    connected (the GPU count decides the default placement, as for ``load_model(..., replicas=N)``).
    ``deploy_id`` (a new random one by default) is part of the deployment's identity (:mod:`.identity`)."""
    import ray
    from ray import serve as ray_serve

    from ..actors.replica import ReplicaSpec
    from ..capabilities import backend_class
    from ..dtypes import dtype_name
    from .replica import CaptureReplica
    from .status import DEPLOYMENT

    tp = int(backend_options.get("tensor_parallel_size", 1))
    if gpus_per_replica is None:
        gpus_per_replica = tp if ray.cluster_resources().get("GPU", 0) and device in (None, "cuda") else 0
    if device is None and gpus_per_replica and backend_class(backend).capabilities.takes_device:
        device = "cuda"
    spec = ReplicaSpec(str(model), backend, dtype_name(dtype), device, tuple(sorted(backend_options.items())),
                       torch_threads)
    actor = {"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica}
    if env_vars:
        actor["runtime_env"] = {"env_vars": {k: str(v) for k, v in env_vars.items()}}
    count = scaling.get("num_replicas") or scaling["autoscaling_config"]["min_replicas"]
    facts = {"name": name, "url": url, "model": str(model), "backend": backend, "replicas": count,
             "limits": dataclasses.asdict(limits), "deploy_id": deploy_id or secrets.token_hex(8),
             "max_ongoing_requests": max_ongoing_requests, "max_queued_requests": max_queued_requests}
    # Serve counts an HTTP request from before its body arrives: room for max_uploads bodies being
    # received beside the max_ongoing_requests that run (the replica's own slots, http_guard.Slots)
    deployment = ray_serve.deployment(
        CaptureReplica, name=DEPLOYMENT, ray_actor_options=actor,
        max_ongoing_requests=max_ongoing_requests + limits.max_uploads,
        max_queued_requests=max_queued_requests,
        backpressure_config={"status_code": 503, "retry_after_s": RETRY_AFTER_S},
        max_constructor_retry_count=count, health_check_period_s=2, health_check_timeout_s=30, **scaling)
    return deployment.bind(spec, token_sha256, limits, facts), count


def build(args: dict):
    """The application ``serve deploy`` builds from a config file's ``args``: ``name`` and ``model``
    (required), ``backend``, ``replicas`` (or ``min_replicas`` / ``max_replicas``), ``limits`` (a
    dict of :class:`Limits` fields), placement and backend options as ``serve(...)`` takes them.
    A new token is written where this runs (the head node's ``~/.cache/interp_engine/service/NAME.token``,
    mode 0600); the config's own ``deployments:`` entries (``num_replicas``, ``ray_actor_options``)
    apply on top."""
    from ray.serve.context import _get_global_client

    from .auth import new_token, token_sha256, write_token

    args = dict(args)
    missing = [k for k in ("name", "model") if not args.get(k)]
    if missing:
        raise InputError(f"the service's args need {' and '.join(missing)} (e.g. name: smollm2, model: "
                         f"HuggingFaceTB/SmolLM2-135M-Instruct)")
    name, model = args.pop("name"), args.pop("model")
    scaling = scaling_of(args.pop("replicas", 1), args.pop("min_replicas", None), args.pop("max_replicas", None))
    limits = Limits(**args.pop("limits", {}))
    config = _get_global_client().http_config
    url = f"http://{config.host}:{config.port}/{name}"
    token = new_token()
    bound, _ = application(model, name, url, token_sha256(token), scaling=scaling, limits=limits, **args)
    write_token(name, token, url)
    return bound


def scaling_of(replicas, min_replicas, max_replicas) -> dict:
    """Serve's ``num_replicas``, or its autoscaling between ``min_replicas`` and ``max_replicas`` by queue length."""
    def positive(value, what) -> int:
        number = integer(value)
        if number is None or number < 1:
            raise InputError(f"{what} must be a positive int, got {value!r}")
        return number

    if min_replicas is None and max_replicas is None:
        return {"num_replicas": positive(replicas, "replicas")}
    low = replicas if min_replicas is None else min_replicas
    high = max_replicas if max_replicas is not None else low
    low = positive(low, "min_replicas")
    high = positive(high, "max_replicas")
    if high < low:
        raise InputError(f"max_replicas={high} is below min_replicas={low}")
    return {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas": low,
                                   "target_ongoing_requests": 2, "upscale_delay_s": 2, "downscale_delay_s": 60}}


