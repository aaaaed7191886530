"""Benchmark: a token-layout dataset build at scale through a 2-node cluster (SmolLM2, 3 points).

    .venv/bin/python bench/dataset_scale.py [--prompts 10000] [--small 1000] [--dtype bfloat16]

Starts a simulated cluster (a head with no CPUs, two 1-CPU worker nodes), and runs each build in
a fresh driver process that joins it with 2 replicas (1 pinned torch thread each):

1. the full build of ``--prompts`` prompts: tokens/s, and bytes written per token next to the
   raw bytes of the captured values (points x d_model x the stored dtype's size);
2. the same build of ``--small`` prompts: peak RSS of the driver and of a replica, large / small
   (flat memory: ~1.0);
3. the full build again, its driver killed once half the shards are written, then rerun: time of
   the rerun / time of the full build (ideal ~0.5, plus start-up), and the resumed result checked
   equal to the full build file by file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rss import replicas_peak_rss_mb

WORDS = "the of and a to in is was he for it with as his on be at by had are but from or have an they".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 10)) for i in range(n)]


def child(args) -> None:
    """One build in this process, joined to the cluster at RAY_ADDRESS; prints its facts as JSON."""
    import resource

    import ray

    from interp_engine import build_dataset, load_model

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    model = load_model(args.model, replicas=2, cpus_per_replica=1, torch_threads=1)
    layer = model.n_layers // 2
    points = [f"resid_post.{layer}", f"mlp_out.{layer}", f"attn_out.{layer}"]
    start = time.perf_counter()
    ds = build_dataset(model, prompts(args.n), points, args.out, layout="token", dtype=args.dtype,
                       shard_size=args.shard_size, progress=False)
    seconds = time.perf_counter() - start
    replica_mb = max(replicas_peak_rss_mb(model))
    d_model = model.info.d_model
    model.close()
    written = sum(rec["bytes"] for rec in ds.manifest["shards"].values())
    print(json.dumps({"n": args.n, "seconds": seconds, "tokens": ds.tokens, "rows": ds.rows, "bytes": written,
                      "raw_bytes_per_token": len(points) * d_model * {"float32": 4}.get(args.dtype, 2),
                      "resumed": ds.resumed_shards, "shards": ds.shards,
                      "driver_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "replica_mb": replica_mb}))


def run_child(args, n: int, out: Path, env: dict) -> dict:
    command = [sys.executable, __file__, "--child", "--n", str(n), "--out", str(out), "--model", args.model,
               "--dtype", args.dtype, "--shard-size", str(args.shard_size)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def killed_then_resumed(args, out: Path, env: dict, n_shards: int) -> tuple[int, dict]:
    command = [sys.executable, __file__, "--child", "--n", str(args.prompts), "--out", str(out), "--model",
               args.model, "--dtype", args.dtype, "--shard-size", str(args.shard_size)]
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while len(list(out.glob("part-*.parquet"))) < n_shards // 2 and driver.poll() is None:
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    written = len(list(out.glob("part-*.parquet")))
    time.sleep(2)  # the killed driver's replicas go with it
    return written, run_child(args, args.prompts, out, env)


def main() -> None:
    from interp_engine.embedded import NAME

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=NAME)
    parser.add_argument("--prompts", type=int, default=10000)
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "TOKENIZERS_PARALLELISM": "false"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            full = run_child(args, args.prompts, Path(tmp) / "full", env)
            small = run_child(args, args.small, Path(tmp) / "small", env)
            partial, resumed = killed_then_resumed(args, Path(tmp) / "resumed", env, full["shards"])
            same = all((Path(tmp) / "full" / f.name).read_bytes() == f.read_bytes()
                       for f in sorted((Path(tmp) / "resumed").glob("part-*.parquet")))
    finally:
        ray.shutdown()
        cluster.shutdown()
    result = {
        "prompts": args.prompts, "tokens": full["tokens"], "seconds": full["seconds"],
        "tokens_per_s": full["tokens"] / full["seconds"],
        "bytes_written_per_token": full["bytes"] / full["tokens"],
        "raw_bytes_per_token": full["raw_bytes_per_token"],
        "written_over_raw": full["bytes"] / full["tokens"] / full["raw_bytes_per_token"],
        "driver_rss_ratio": full["driver_mb"] / small["driver_mb"],
        "replica_rss_ratio": full["replica_mb"] / small["replica_mb"],
        "rss_mb": {"small": [small["driver_mb"], small["replica_mb"]], "full": [full["driver_mb"], full["replica_mb"]]},
        "killed_with_shards": partial, "shards": full["shards"], "resumed_shards": resumed["resumed"],
        "resume_seconds": resumed["seconds"], "resume_over_full": resumed["seconds"] / full["seconds"],
        "resumed_equals_full": same,
    }
    print(json.dumps(result, indent=2))
    print(f"{args.prompts} prompts, {full['tokens']} tokens: {result['tokens_per_s']:.0f} tokens/s; "
          f"{result['bytes_written_per_token']:.0f} bytes written per token vs {full['raw_bytes_per_token']} raw "
          f"({result['written_over_raw']:.3f})")
    print(f"peak RSS {args.prompts} / {args.small} prompts: driver {result['driver_rss_ratio']:.3f}, "
          f"replica {result['replica_rss_ratio']:.3f}")
    print(f"resume after a kill at {partial}/{full['shards']} shards: {result['resume_over_full']:.3f} of the full "
          f"build's time; resumed == full: {same}")


if __name__ == "__main__":
    main()
