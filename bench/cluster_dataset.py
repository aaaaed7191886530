"""Benchmark: activation-dataset builds through the Ray cluster vs a local loop.

    .venv/bin/python bench/cluster_dataset.py [--model NAME] [--prompts 96] [--rss-prompts 100 1000]

Three ratios, each measured side by side in one run (absolute times on shared machines are noise):

1. overhead: ``build_dataset`` through a cluster model with 1 replica / the same build with the
   model in this process (same captures, same Parquet writes, same torch threads — 1 by default,
   as oversubscribed multi-threaded torch on a shared 2-core box swings by several x). Runs are
   interleaved and the best of ``--repeats`` kept. Target <= 1.15.
2. scaling: 2 replicas on 2 nodes (one pinned torch thread each) / 1 replica (one thread), the
   two builds interleaved, each model's replicas on nodes of their own: time ratio (best of each,
   and the median of the pairs), ideally 0.5 where the machine has 2 free cores. Beside it, the floors this machine
   sets with no Ray at all: two spinning processes, and two processes doing a replica's work, at
   once / one after the other (the latter again beside the idle Ray cluster, whose daemons share
   the same cores); and where the builds' time goes (Ray's timeline, CPU seconds by role for a
   2-replica and a 1-replica build, the replica's work by phase).
3. memory: peak RSS of a build of 1,000 prompts / 100 prompts, for the driver and a replica,
   each build in a fresh process. Target <= 1.2 (shards stream; nothing grows with the prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rss import replicas_peak_rss_mb

WORDS = "the of and a to in is was he for it with as his on be at by had are but from or have an they".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 10)) for i in range(n)]


def timed_build(model, texts, points, out) -> float:
    """One full build into a fresh folder (a reused folder would resume: nothing to do)."""
    return split_build(model, texts, points, out)[0]


def split_build(model, texts, points, out) -> tuple[float, list[int]]:
    """:func:`timed_build`, and how many shards each replica wrote (from the manifest)."""
    from interp_engine import build_dataset

    out = Path(f"{out}-{uuid.uuid4().hex[:8]}")
    start = time.perf_counter()
    dataset = build_dataset(model, texts, points, out, layout="token", shard_size=8, progress=False)
    elapsed = time.perf_counter() - start
    writers = [r.get("replica", -1) for r in dataset.manifest["shards"].values()]
    shutil.rmtree(out)
    return elapsed, sorted((writers.count(r) for r in set(writers)), reverse=True)


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
    for _ in range(3):  # the 1-replica model on one node, the 2-replica one on the other two
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
        two = load_model(args.model, replicas=2, cpus_per_replica=1, torch_threads=1)
        nodes = len(set(two.nodes))
        timed_build(one_pinned, texts[:8], points, work / "warm-1")
        timed_build(two, texts[:16], points, work / "warm-2")
        scaling = []  # interleaved (the idle model's replica waits on its own node), so both see the same load
        for _ in range(args.repeats):
            single = split_build(one_pinned, texts, points, work / "single")
            scaling.append((single[0], *split_build(two, texts, points, work / "double")))
        single_s, double_s = min(p[0] for p in scaling), min(p[1] for p in scaling)
        before = time.time()
        traced_s, traced_cpu = build_with_cpu(two, texts, points, work / "traced")
        busy = {**replica_busy(ray.timeline(), before), "build_s": traced_s, "cpu_s": traced_cpu}
        one_s_traced, one_cpu = build_with_cpu(one_pinned, texts, points, work / "traced-1")
        beside_ray = workload_parallelism(args)  # the same floor, with this idle cluster's daemons running
        one_pinned.close()
        two.close()
        parts = phases(args.model, texts, points, work)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"prompts": args.prompts, "local_s": local_s, "cluster_1_replica_s": one_s,
            "overhead_ratio": one_s / local_s, "one_replica_1_thread_s": single_s,
            "two_replicas_1_thread_s": double_s, "scaling_time_ratio": double_s / single_s, "nodes": nodes,
            "scaling_pairs": [{"one_s": a, "two_s": b, "ratio": b / a, "shards_per_replica": split}
                              for a, b, split in scaling],
            "scaling_ratio_median": statistics.median(b / a for a, b, _ in scaling),
            "two_replicas_busy": busy, "one_replica_traced": {"build_s": one_s_traced, "cpu_s": one_cpu},
            "in_process_phases_s": parts, "workload_parallelism_beside_ray": beside_ray}


def build_with_cpu(model, texts, points, out) -> tuple[float, dict[str, float]]:
    """:func:`timed_build`, and the CPU seconds each role used meanwhile (:func:`cpu_by_role`)."""
    before = cpu_seconds()
    elapsed = timed_build(model, texts, points, out)
    return elapsed, cpu_by_role(before, cpu_seconds())


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process on the machine: its command line and CPU seconds so far."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None:
            out[proc.info["pid"]] = (" ".join(proc.info["cmdline"] or [proc.info["name"] or ""]), times.user + times.system)
    return out


ROLES = (("ReplicaActor", "replicas"), ("CoordinatorActor", "coordinator"), ("raylet", "raylets"),
         ("gcs_server", "GCS"), ("agent", "Ray agents"), ("dashboard", "Ray agents"), ("ray::", "other Ray workers"))


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each role used between two :func:`cpu_seconds` snapshots."""
    used: dict[str, float] = {}
    for pid, (command, seconds) in after.items():
        role = "driver" if pid == os.getpid() else next((r for key, r in ROLES if key in command), "other processes")
        used[role] = used.get(role, 0.0) + seconds - before.get(pid, ("", 0.0))[1]
    return dict(sorted(used.items(), key=lambda item: -item[1]))


def roles(cpu: dict[str, float]) -> str:
    """A :func:`cpu_by_role` result as one line, leaving out roles under 0.01 s."""
    return ", ".join(f"{role} {seconds:.2f}" for role, seconds in cpu.items() if seconds >= 0.01)


def replica_busy(events: list[dict], since: float) -> dict:
    """From Ray's task timeline, the last build's ``write_shard`` calls on each replica worker:
    busy seconds, the span from the build's first shard to the replica's last, and the shards."""
    calls = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).endswith("write_shard")
             and e["ts"] / 1e6 >= since]
    start = min((e["ts"] for e in calls), default=0)
    lead_in = start / 1e6 - since  # the build's start to its first shard's
    per: dict[str, dict] = {}
    for e in calls:
        r = per.setdefault(str(e["tid"]), {"busy_s": 0.0, "shards": 0, "last_end_s": 0.0})
        r["busy_s"] += e["dur"] / 1e6
        r["shards"] += 1
        r["last_end_s"] = max(r["last_end_s"], (e["ts"] + e["dur"] - start) / 1e6)
    return {"replicas": list(per.values()), "lead_in_s": lead_in,
            "first_to_last_s": max((r["last_end_s"] for r in per.values()), default=0)}


_SPIN = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(128, 576), torch.randn(576, 1536)
start = time.perf_counter()
for _ in range({n}):
    a @ b
print(time.perf_counter() - start)
"""


def machine_parallelism(n: int = 4000) -> float:
    """Two single-threaded compute processes at once / the same two one after the other (wall):
    the best time ratio any two replicas can reach on this machine (0.5 with two free cores)."""
    def run(k: int) -> float:
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", _SPIN.format(n=n)], stdout=subprocess.DEVNULL)
                 for _ in range(k)]
        for p in procs:
            p.wait()
        return time.perf_counter() - start

    run(1)
    return min(run(2) / (2 * run(1)) for _ in range(3))


def replica_work(model, texts, points, store) -> dict:
    """A replica's whole work for one build (96 prompts in shards of 8), done in this process, in
    seconds by phase: capture and Arrow encoding (``capture_table``), Parquet encoding, the write."""
    from interp_engine.dataset.shard import ShardSpec, capture_table, shard_bytes

    spec = ShardSpec(store, tuple(points), "token", "float32", 64, -(-len(texts) // 8), 8)
    out = {"capture_and_table": 0.0, "parquet": 0.0, "write": 0.0}
    for index in range(spec.n_shards):
        t0 = time.perf_counter()
        table, _ = capture_table(model, spec, index, texts[index * 8:(index + 1) * 8])
        t1 = time.perf_counter()
        data = shard_bytes(table)
        t2 = time.perf_counter()
        store.write(spec.name(index), data)
        out["capture_and_table"] += t1 - t0
        out["parquet"] += t2 - t1
        out["write"] += time.perf_counter() - t2
    return out


def phases(model_name: str, texts, points, work: Path) -> dict:
    """:func:`replica_work` with the model loaded in this process (one torch thread)."""
    from interp_engine import load_model
    from interp_engine.dataset.store import Store

    (work / "phases").mkdir()
    return replica_work(load_model(model_name), texts, points, Store.of(str(work / "phases")))


def work_child(args) -> None:
    """``--work-child``: load the model with one torch thread, say ``ready``, then do a replica's
    whole build work (:func:`replica_work`) each time a line arrives on stdin."""
    import torch

    from interp_engine import load_model
    from interp_engine.dataset.store import Store

    torch.set_num_threads(1)
    model = load_model(args.model)
    texts, layer = prompts(args.prompts), model.n_layers // 2
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.of(tmp)
        print("ready", flush=True)
        for _ in sys.stdin:
            replica_work(model, texts, [f"resid_post.{layer}", f"mlp_out.{layer}"], store)
            print("done", flush=True)


def workload_parallelism(args, rounds: int = 3) -> float:
    """:func:`machine_parallelism` for the replicas' own work: two processes each doing a whole
    build's captures and encoding, at once / one after the other (median of ``rounds``). A model
    forward streams the weights from memory, which two cores share, so this floor can sit above
    the spinning one; it is what two replicas on this machine can reach with no Ray at all."""
    command = [sys.executable, __file__, "--work-child", "--model", args.model, "--prompts", str(args.prompts)]
    children = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True) for _ in range(2)]
    try:
        for child in children:
            while child.stdout.readline().strip() != "ready":
                pass

        def go(group) -> float:
            start = time.perf_counter()
            for child in group:
                child.stdin.write("go\n")
                child.stdin.flush()
            for child in group:
                child.stdout.readline()
            return time.perf_counter() - start

        go(children)  # first-call costs out of the way
        ratios = []
        for _ in range(rounds):
            one_after_the_other = go(children[:1]) + go(children[1:])
            ratios.append(go(children) / one_after_the_other)
        return statistics.median(ratios)
    finally:
        for child in children:
            child.stdin.close()
            child.wait()


def rss_child(args) -> None:
    """One build in this fresh process; prints peak RSS (MiB) of the driver and the replica."""
    import ray

    from interp_engine import load_model
    from interp_engine.loopback import start_local_ray

    start_local_ray(num_cpus=2)
    model = load_model(args.model, replicas=1, cpus_per_replica=1, torch_threads=1)
    layer = model.n_layers // 2
    with tempfile.TemporaryDirectory() as tmp:
        timed_build(model, prompts(args.n), [f"resid_post.{layer}"], Path(tmp) / "d")
    replica = replicas_peak_rss_mb(model)[0]
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
    parser.add_argument("--work-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.n is not None:
        rss_child(args)
        return
    if args.work_child:
        work_child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = overhead_and_scaling(args, Path(tmp))
    result["machine_parallelism"] = machine_parallelism()
    result["workload_parallelism"] = workload_parallelism(args)
    if not args.skip_memory:
        result.update(memory(args))
    print(json.dumps(result, indent=2))
    print(f"overhead (cluster 1 replica / local): {result['overhead_ratio']:.3f}  (target <= 1.15)")
    print(f"scaling (2 replicas on {result['nodes']} nodes / 1 replica, time): {result['scaling_time_ratio']:.3f} "
          f"(best of each: {result['two_replicas_1_thread_s']:.2f} s / {result['one_replica_1_thread_s']:.2f} s; "
          f"median of the interleaved pairs {result['scaling_ratio_median']:.3f}; target <= 0.55)")
    print("  pairs: " + ", ".join(f"{p['ratio']:.3f} (shards {'+'.join(map(str, p['shards_per_replica']))})"
                                  for p in result["scaling_pairs"]))
    print(f"this machine: two single-threaded compute processes at once / one after the other "
          f"{result['machine_parallelism']:.3f}; two processes doing a replica's work at once / one after the other "
          f"{result['workload_parallelism']:.3f} (the floor of the scaling ratio without Ray; load average "
          f"{os.getloadavg()[0]:.2f}); the same with this benchmark's Ray cluster up and idle "
          f"{result['workload_parallelism_beside_ray']:.3f}")
    busy, parts = result["two_replicas_busy"], result["in_process_phases_s"]
    print("2 replicas, one traced build: " + ", ".join(
        f"replica busy {r['busy_s']:.2f} s ({r['shards']} shards, last done at {r['last_end_s']:.2f} s)"
        for r in busy["replicas"]) + f"; build {busy['build_s']:.2f} s: start to first shard {busy['lead_in_s']:.2f} s, "
        f"first shard to last {busy['first_to_last_s']:.2f} s, the rest (manifest, checks) "
        f"{busy['build_s'] - busy['lead_in_s'] - busy['first_to_last_s']:.2f} s")
    one = result["one_replica_traced"]
    print("CPU seconds during that build, by role: " + roles(busy["cpu_s"]))
    print(f"CPU seconds during a 1-replica build ({one['build_s']:.2f} s), by role: " + roles(one["cpu_s"]))
    total = sum(parts.values())
    print("the replicas' work done in this process, by phase: " + ", ".join(
        f"{name} {seconds:.2f} s ({seconds / total:.0%})" for name, seconds in parts.items()))
    if not args.skip_memory:
        print(f"peak RSS {args.rss_prompts[1]} vs {args.rss_prompts[0]} prompts: driver "
              f"{result['driver_rss_ratio']:.3f}, replica {result['replica_rss_ratio']:.3f}  (target <= 1.2)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
