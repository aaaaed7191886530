"""Autoscaling on a simulated multi-node cluster: a service deployed with min_replicas=1,
max_replicas=2 (each replica holding one fake GPU, so each lands on a worker node of its own)
gets a second replica, on the other node, while clients keep its one replica busy."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import pytest

from interp_engine import capture_generation, connect, serve, shutdown

from ..clusters import simulated_cluster

ray = pytest.importorskip("ray")


def test_a_busy_service_scales_up_onto_another_node(tiny_path, tmp_path):
    from interp_engine.loopback import free_port
    from ray import serve as ray_serve

    saved = os.environ.get("INTERP_ENGINE_CACHE")
    os.environ["INTERP_ENGINE_CACHE"] = str(tmp_path)
    with simulated_cluster():
        try:
            info = serve(str(tiny_path("llama")), name="scaling", min_replicas=1, max_replicas=2, port=free_port(),
                         gpus_per_replica=1, cpus_per_replica=0.5, device="cpu", torch_threads=1)
            model = connect("scaling")
            assert model.status()["replicas"] == {"RUNNING": 1}
            stop = threading.Event()
            tokens = model.to_tokens("Hello")

            def busy():
                while not stop.is_set():
                    capture_generation(model, tokens, ["resid_post.1"], max_tokens=48, stop_at_eos=False)

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                workers = [pool.submit(busy) for _ in range(8)]
                deadline = time.monotonic() + 180
                while model.status()["replicas"] != {"RUNNING": 2} and time.monotonic() < deadline:
                    time.sleep(1)
                # A replica that Serve reports RUNNING reaches the handle's router a moment later:
                # ask until both nodes answer (or the deadline passes and the assertion says so).
                nodes = set()
                deadline = time.monotonic() + 60
                while len(nodes) < 2 and time.monotonic() < deadline:
                    nodes.add(model.transport.call("describe")["node"])
                stop.set()
                for w in workers:
                    w.result()
            assert model.status()["replicas"] == {"RUNNING": 2}
            workers_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}
            assert nodes == workers_nodes and len(nodes) == 2
            shutdown(info.name)
        finally:
            ray_serve.shutdown()
            if saved is None:
                os.environ.pop("INTERP_ENGINE_CACHE", None)
            else:
                os.environ["INTERP_ENGINE_CACHE"] = saved
