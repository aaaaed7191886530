"""Benchmark: activation-dataset builds through the Ray cluster vs a local loop.

    .venv/bin/python bench/cluster_dataset.py [--model NAME] [--prompts 96] [--rss-prompts 100 1000]

Three ratios, each measured side by side in one run (absolute times on shared machines are noise):

1. overhead: ``build_dataset`` through a cluster model with 1 replica / the same build with the
   model in this process (same captures, same Parquet writes, same torch threads — 1 by default,
   as oversubscribed multi-threaded torch on a shared 2-core box swings by several x). Runs are
   interleaved and the best of ``--repeats`` kept. Target <= 1.15.
2. scaling: 2 replicas on 2 nodes (one pinned torch thread each) / 1 replica (one thread):
   time ratio, ideally 0.5 where the machine has 2 free cores.
3. memory: peak RSS of a build of 1,000 prompts / 100 prompts, for the driver and a replica,
   each build in a fresh process. Target <= 1.2 (shards stream; nothing grows with the prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

WORDS = "the of and a to in is was he for it with as his on be at by had are but from or have an they".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 10)) for i in range(n)]


def timed_build(model, texts, points, out) -> float:
    """One full build into a fresh folder (a reused folder would resume: nothing to do)."""
    from interp_engine import build_dataset

    out = Path(f"{out}-{uuid.uuid4().hex[:8]}")
    start = time.perf_counter()
    build_dataset(model, texts, points, out, layout="token", shard_size=8, progress=False)
    elapsed = time.perf_counter() - start
    shutil.rmtree(out)
    return elapsed


def overhead_and_scaling(args, work: Path) -> dict:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from interp_engine import load_model

    texts = prompts(args.prompts)
    threads = args.threads
    torch.set_num_threads(threads)  # the local side gets exactly the replica's threads
    local = load_model(args.model)
    points = [f"resid_post.{local.n_layers // 2}", f"mlp_out.{local.n_layers // 2}"]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        one = load_model(args.model, replicas=1, cpus_per_replica=1, torch_threads=threads)
        timed_build(local, texts[:8], points, work / "warm-local")
        timed_build(one, texts[:8], points, work / "warm-one")
        pairs = [(timed_build(local, texts, points, work / "local"), timed_build(one, texts, points, work / "one"))
                 for _ in range(args.repeats)]  # interleaved, so both sides see the same machine load
        local_s, one_s = min(p[0] for p in pairs), min(p[1] for p in pairs)
        one.close()
        one_pinned = load_model(args.model, replicas=1, cpus_per_replica=1, torch_threads=1)
        timed_build(one_pinned, texts[:8], points, work / "warm-1")
        single_s = min(timed_build(one_pinned, texts, points, work / "single") for _ in range(args.repeats))
        one_pinned.close()
        two = load_model(args.model, replicas=2, cpus_per_replica=1, torch_threads=1)
        nodes = len(set(two.nodes))
        timed_build(two, texts[:16], points, work / "warm-2")
        double_s = min(timed_build(two, texts, points, work / "double") for _ in range(args.repeats))
        two.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"prompts": args.prompts, "local_s": local_s, "cluster_1_replica_s": one_s,
            "overhead_ratio": one_s / local_s, "one_replica_1_thread_s": single_s,
            "two_replicas_1_thread_s": double_s, "scaling_time_ratio": double_s / single_s, "nodes": nodes}


def rss_child(args) -> None:
    """One build in this fresh process; prints peak RSS (MiB) of the driver and the replica."""
    import ray

    from interp_engine import load_model

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    model = load_model(args.model, replicas=1, cpus_per_replica=1, torch_threads=1)
    layer = model.n_layers // 2
    with tempfile.TemporaryDirectory() as tmp:
        timed_build(model, prompts(args.n), [f"resid_post.{layer}"], Path(tmp) / "d")
    replica = ray.get(model._replicas[0].peak_rss_mb.remote())
    model.close()
    ray.shutdown()
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"n": args.n, "driver_mb": driver, "replica_mb": replica}))


def memory(args) -> dict:
    out = {}
    for n in args.rss_prompts:
        done = subprocess.run([sys.executable, __file__, "--rss-child", str(n), "--model", args.model],
                              capture_output=True, text=True, check=True)
        out[n] = json.loads(done.stdout.strip().splitlines()[-1])
    small, large = (out[n] for n in args.rss_prompts)
    return {"rss": out, "driver_rss_ratio": large["driver_mb"] / small["driver_mb"],
            "replica_rss_ratio": large["replica_mb"] / small["replica_mb"]}


def main() -> None:
    from interp_engine.embedded import NAME

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=NAME)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, local and per replica")
    parser.add_argument("--rss-prompts", type=int, nargs=2, default=[100, 1000])
    parser.add_argument("--rss-child", type=int, dest="n", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.n is not None:
        rss_child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = overhead_and_scaling(args, Path(tmp))
    if not args.skip_memory:
        result.update(memory(args))
    print(json.dumps(result, indent=2))
    print(f"overhead (cluster 1 replica / local): {result['overhead_ratio']:.3f}  (target <= 1.15)")
    print(f"scaling (2 replicas on {result['nodes']} nodes / 1 replica, time): {result['scaling_time_ratio']:.3f}")
    if not args.skip_memory:
        print(f"peak RSS {args.rss_prompts[1]} vs {args.rss_prompts[0]} prompts: driver "
              f"{result['driver_rss_ratio']:.3f}, replica {result['replica_rss_ratio']:.3f}  (target <= 1.2)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
