"""One simulated cluster for every module in this folder: a head and two worker nodes with one fake
GPU each (tests/clusters.py), two eager replicas of the tiny llama on the workers, and, when a vLLM
test asks, one vLLM replica on the head. Started once for the folder (package scope) rather than
once per module: a cluster with its replicas takes 10-15 s to start here, a vLLM replica as long
again.

The tests share the models, so none may change them for the others: each counts bytes or objects
as a difference from before its own call, and one that kills or restarts a replica (or needs
another family) loads its own CPU-only model beside these (the workers keep half a CPU free)."""

from __future__ import annotations

import pytest

from ...clusters import REPLICA, simulated_cluster, vllm_replica


@pytest.fixture(scope="package")
def cluster():
    with simulated_cluster() as c:
        yield c


@pytest.fixture(scope="package")
def cluster_llama(cluster, tiny_path):
    from interp_engine import load_model

    model = load_model(str(tiny_path("llama")), replicas=2, **REPLICA)
    yield model
    model.close()


@pytest.fixture(scope="package")
def cluster_vllm(cluster, tiny_path):
    """A vLLM replica on the same cluster (CPU only: it lands on the head node)."""
    pytest.importorskip("vllm")
    with vllm_replica(str(tiny_path("llama"))) as model:
        yield model
