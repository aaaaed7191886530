"""A simulated multi-node Ray cluster for the tests (``ray.cluster_utils.Cluster``): a head and
worker nodes on this machine, the workers with fake GPUs where asked, so GPU-placed replicas
spread over nodes without a GPU. The same shape everywhere the tests need a cluster."""

from __future__ import annotations

import contextlib


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
