"""The cluster configs in cluster/: parsed and checked for the properties we rely on (token auth
on every node, dashboard on loopback, GPU workers whose declared GPUs match what they get)."""

from __future__ import annotations

from pathlib import Path

import ray
import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def test_launcher_config():
    config = yaml.safe_load((CLUSTER / "launcher-gpu.yaml").read_text())
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert types[config["head_node_type"]]["resources"].get("GPU", 0) == 0
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, "no GPU worker type"
    for t in types.values():
        assert t.get("min_workers", 0) <= t.get("max_workers", config["max_workers"]) <= config["max_workers"]
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "RAY_AUTH_MODE=token" in head
    assert "RAY_AUTH_MODE=token" in " ".join(config["worker_start_ray_commands"])
    assert "~/.ray/auth_token" in config["file_mounts"]
    assert any("interp_engine[cuda]" in c for c in config["setup_commands"])


def test_kuberay_manifest():
    doc = yaml.safe_load((CLUSTER / "kuberay-raycluster.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    spec = doc["spec"]
    assert spec["rayVersion"] == ray.__version__
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    groups = spec["workerGroupSpecs"]
    assert groups and len({g["groupName"] for g in groups}) == len(groups)
    containers = [c for c in head["template"]["spec"]["containers"]]
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == int(group["rayStartParams"]["num-gpus"]) >= 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        containers.append(container)
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
        assert container["image"].startswith(f"rayproject/ray:{ray.__version__}")
