"""A simulated multi-node Ray cluster for the tests (``ray.cluster_utils.Cluster``): a head and
worker nodes on this machine, the workers with fake GPUs where asked, so GPU-placed replicas
spread over nodes without a GPU. The same shape everywhere the tests need a cluster."""

from __future__ import annotations

import contextlib

#: eager replicas that ask for one (fake) GPU each, so they land on the two worker nodes, with one
#: torch thread each (a local oracle pinned to it runs the same computation on a replica's rows)
REPLICA = dict(gpus_per_replica=1, cpus_per_replica=0.5, device="cpu", torch_threads=1)


@contextlib.contextmanager
def simulated_cluster(workers: int = 2, *, worker_gpus: int = 1):
    """Start the cluster, connect this process to it, and tear both down afterwards."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=1, num_gpus=worker_gpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def vllm_replica(path: str):
    """One vLLM replica on the connected cluster, CPU only (it lands on the head node)."""
    from interp_engine import load_model

    model = load_model(path, backend="vllm", replicas=1, gpus_per_replica=0, cpus_per_replica=0.5,
                       env_vars={"VLLM_CPU_KVCACHE_SPACE": "1"}, max_model_len=128)
    try:
        yield model
    finally:
        model.close()
