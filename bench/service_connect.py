"""Benchmark: how long ``connect(url)`` takes, and what the first ``to_tokens`` adds (issue 36).

    flock -w 1200 /work/wt/heavy.lock .venv/bin/python bench/service_connect.py [--model NAME] [--reps 5]

Deploys ``--model`` (1 replica) on the library's own loopback Ray started here, then, ``--reps``
times, a fresh Python process (the way a new user's script starts) times: ``import interp_engine``,
``connect(url, token=...)`` (``GET /info``; the tokenizer is built on first use), and the first
``to_tokens`` (importing the tokenizer library and building the service's tokenizer). Reported:
the median and the range of each. A benchmark, not a timed test: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
t0 = time.monotonic()
from interp_engine import connect
t1 = time.monotonic()
model = connect(sys.argv[1], token=sys.argv[2])
t2 = time.monotonic()
model.to_tokens("The capital of France is")
t3 = time.monotonic()
print(json.dumps({"import": t1 - t0, "connect": t2 - t1, "first_to_tokens": t3 - t2}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    from interp_engine import serve, shutdown
    from interp_engine.loopback import free_port, start_local_ray

    start_local_ray(num_cpus=2)
    info = serve(args.model, name="bench-connect", replicas=1, port=free_port(), cpus_per_replica=0.5,
                 torch_threads=1)
    runs = []
    try:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # an HTTP client needs no Ray
        for _ in range(args.reps):
            out = subprocess.run([sys.executable, "-c", CHILD, info.url, info.token], capture_output=True,
                                 text=True, env=env, timeout=300, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        shutdown("bench-connect")
    print(f"model {args.model}, {args.reps} fresh processes, seconds (median [min, max]):")
    for key in ("import", "connect", "first_to_tokens"):
        values = [r[key] for r in runs]
        print(f"  {key:16s} {statistics.median(values):6.2f}  [{min(values):.2f}, {max(values):.2f}]")


if __name__ == "__main__":
    main()
