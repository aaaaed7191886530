"""Where a cluster model's replicas run: joining a Ray cluster, checking that it can hold the
replicas before placing any (no silent hang), reserving their share in one placement group spread
over the nodes (each replica's GPUs on one node), and giving it all back on close."""

from __future__ import annotations

import dataclasses

from ..errors import ClusterError
from ..loopback import connect as connect


def check_capacity(nodes: list[dict], replicas: int, gpus: float, cpus: float) -> None:
    """Raise a :class:`ClusterError` unless ``replicas`` replicas of ``gpus`` GPUs (on one node)
    and ``cpus`` CPUs each fit on ``nodes`` (``ray.nodes()`` entries)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    have = [n.get("Resources", {}) for n in alive]
    per_node_gpu = [r.get("GPU", 0) for r in have]
    shown = ", ".join(f"node {i}: {r.get('GPU', 0):g} GPU / {r.get('CPU', 0):g} CPU" for i, r in enumerate(have)) or "none"
    if gpus and max(per_node_gpu, default=0) < gpus:
        raise ClusterError(
            f"each replica needs {gpus:g} GPUs on one node (tensor_parallel_size), but no node has that many "
            f"({shown}). Lower tensor_parallel_size / gpus_per_replica, or add a node with {gpus:g} GPUs."
        )
    fits = sum(int(g // gpus) for g in per_node_gpu) if gpus else replicas
    if cpus:
        fits = min(fits, sum(int(r.get("CPU", 0) // cpus) for r in have))
    if fits < replicas:
        raise ClusterError(
            f"{replicas} replicas of {gpus:g} GPU and {cpus:g} CPU each do not fit this cluster ({shown}): "
            f"at most {fits} fit. Use replicas={max(fits, 1)}, lower cpus_per_replica/gpus_per_replica, or add nodes."
        )


@dataclasses.dataclass
class Placement:
    """A placement group (None when replicas reserve nothing) and one scheduling strategy per replica."""

    group: object | None
    strategies: list


def place(replicas: int, gpus: float, cpus: float, timeout: float) -> Placement:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v}
    if not bundle:
        return Placement(None, ["SPREAD"] * replicas)
    group = placement_group([dict(bundle) for _ in range(replicas)], strategy="SPREAD")
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ClusterError(
            f"could not place {replicas} replicas of {bundle} within {timeout:g}s; the cluster has "
            f"{ray.available_resources()} free. Free resources, lower replicas, or raise startup_timeout."
        ) from None
    return Placement(group, [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
                              for i in range(replicas)])


def here():
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)


def release(handles, coordinator, placement) -> None:
    import ray

    for handle in [coordinator, *handles]:
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
    if placement is not None and placement.group is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(placement.group)
        except Exception:
            pass
