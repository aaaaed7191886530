"""Benchmark: the capture service (Ray Serve) next to the same captures on a local model.

    .venv/bin/python bench/service.py [--model NAME] [--point resid_post.10] [--reps 60] [--seconds 6]

Everything runs on the library's own loopback Ray started here, on this machine; absolute times on
a shared machine are noise, so every number is measured side by side in one run:

1. overhead: one prompt ("The capital of France is"), one point, one request at a time, through a
   local model, the Ray client (``connect(name)``) and the HTTP client (``connect(url)``); the
   three alternate in a shuffled order every repetition (bench/timing.py). Reported: medians, the
   service's overhead per request over the local call, and the HTTP path's over the Ray path.
   Every model, local or replica, runs with one torch thread.
2. load: 1, 4 and 16 concurrent clients (threads, each with its own connection) sending that
   request for ``--seconds`` against services of 1 and 2 replicas, through Ray and over HTTP, and
   the same clients on the local model in this process: requests/s, p50 and p99 latency.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import alternate, median  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def load(call, clients: int, seconds: float) -> tuple[float, float, float, int]:
    """(requests/s, p50 ms, p99 ms, requests) of ``clients`` threads calling ``call`` for ``seconds``."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client():
        mine = []
        while time.monotonic() < stop:
            start = time.perf_counter()
            call()
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    return len(latencies) / elapsed, percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3, len(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--point", default="resid_post.10")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    import torch

    from interp_engine import connect, load_model, run_with_cache, serve, shutdown
    from interp_engine.loopback import free_port, start_local_ray

    torch.set_num_threads(1)
    start_local_ray(num_cpus=4)
    port = free_port()
    local = load_model(args.model)
    tokens = local.to_tokens("The capital of France is")
    services = {n: serve(args.model, name=f"bench{n}", replicas=n, port=port, cpus_per_replica=0.5, torch_threads=1)
                for n in (1, 2)}
    ray_model = connect("bench1")
    http_model = connect(services[1].url, token=services[1].token)
    want = run_with_cache(local, tokens, [args.point])[args.point]
    for model in (ray_model, http_model):
        assert torch.equal(run_with_cache(model, tokens, [args.point])[args.point], want)

    print(f"1. overhead: one prompt ({tokens.shape[1]} tokens), {args.point}, {args.model}, 1 replica, "
          f"1 torch thread everywhere; {args.reps} alternating repetitions", flush=True)
    runs = {"local": lambda: run_with_cache(local, tokens, [args.point]),
            "ray": lambda: run_with_cache(ray_model, tokens, [args.point]),
            "http": lambda: run_with_cache(http_model, tokens, [args.point]),
            "ray ping": lambda: ray_model.transport.ping(),
            "http ping": lambda: http_model.transport.ping()}
    wall, _ = _quiet(alternate, runs, args.reps)
    ms = {k: median(v) * 1e3 for k, v in wall.items()}
    paired = {k: statistics.median((a - b) * 1e3 for a, b in zip(wall[k], wall["local"])) for k in ("ray", "http")}
    http_over_ray = statistics.median((a - b) * 1e3 for a, b in zip(wall["http"], wall["ray"]))
    print("   median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    print(f"   overhead per request over the local call (median of paired differences): ray {paired['ray']:.2f} ms, "
          f"http {paired['http']:.2f} ms; http over ray {http_over_ray:.2f} ms")
    print(f"   (a ping: one round trip to a replica that does nothing, the floor of each path)")

    print(f"2. load: {args.seconds:g} s per row, clients are threads of this process", flush=True)
    print(f"   {'path':<6} {'replicas':>8} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>8}")
    for clients in args.clients:
        row = load(lambda: run_with_cache(local, tokens, [args.point]), clients, args.seconds)
        print(f"   {'local':<6} {'-':>8} {clients:>7} {row[0]:>8.1f} {row[1]:>8.2f} {row[2]:>8.2f} {row[3]:>8}", flush=True)
        for replicas, info in services.items():
            for path, model in (("ray", connect(info.name)), ("http", connect(info.url, token=info.token))):
                row = load(lambda: run_with_cache(model, tokens, [args.point]), clients, args.seconds)
                print(f"   {path:<6} {replicas:>8} {clients:>7} {row[0]:>8.1f} {row[1]:>8.2f} {row[2]:>8.2f} "
                      f"{row[3]:>8}", flush=True)
    for info in services.values():
        shutdown(info.name)


def _quiet(alternate_fn, runs, reps):
    """``alternate`` without its per-repetition lines (they are hundreds here)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return alternate_fn(runs, reps, warmup=5)


if __name__ == "__main__":
    main()
