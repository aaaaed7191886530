"""One service for every module in this folder: the library's own loopback Ray, started here, and
a tiny Llama deployed on it with 2 eager replicas (package scope: Serve and the replicas take
~15 s to start). Modules elsewhere in tests/service start Rays of their own, after this one ends."""

from __future__ import annotations

import os

import pytest

from interp_engine import serve, shutdown

from .served import LIMITS, NAME, REPLICA, ROOT


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    """The library's own loopback Ray, and the environment a client process needs to join it."""
    ray = pytest.importorskip("ray")
    from interp_engine.loopback import LOOPBACK_ENV, free_port, start_local_ray
    from ray import serve as ray_serve

    saved = os.environ.get("INTERP_ENGINE_CACHE")
    os.environ["INTERP_ENGINE_CACHE"] = str(tmp_path_factory.mktemp("service_cache"))
    start_local_ray(num_cpus=4)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token",
           **LOOPBACK_ENV, "PYTHONPATH": str(ROOT)}
    try:
        yield {"env": env, "port": free_port()}
    finally:
        ray_serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("INTERP_ENGINE_CACHE", None)
        else:
            os.environ["INTERP_ENGINE_CACHE"] = saved


@pytest.fixture(scope="package")
def service(cluster, tiny_path):
    info = serve(str(tiny_path("llama")), name=NAME, replicas=2, port=cluster["port"], limits=LIMITS, **REPLICA)
    yield info
    shutdown(NAME)
