"""positions=-1 against every position on the vLLM backend: capture time and bytes returned.

SmolLM2-135M (the embedded model), 64 prompts of different lengths, ``resid_post`` at every layer
(the whole site, 30 addresses), prefill only (``await model.capture(...)`` for all 64 at once,
sharing the engine's continuous batching). Two variants on the same engine, side by side in each
repetition (shuffled order):

- ``all``: every position of every prompt;
- ``last``: ``positions=-1``, the last prompt token only (a probe's usual input). The workers drop
  every other row before copying anything.

Bytes returned are what the workers hand to the driver (the workers' ``interp_state``
``bytes_returned``, counted in the worker); time is the wall time of the 64 captures. The report gives medians and the
median of the per-repetition ratios.

    .venv/bin/python bench/positions_vllm.py [--reps 5] [--prompts 64]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from vllm_capture import gather, prompts

from interp_engine import load_model
from interp_engine.backends.vllm.loop import run_on_loop


def bytes_returned(model) -> int:
    """What rank 0 has handed to this process so far (the probe tests/probes.py also uses)."""
    return run_on_loop(model._loop, "interp_state")[0]["bytes_returned"]


def run(model, batch, positions) -> tuple[float, int]:
    before = bytes_returned(model)

    started = time.perf_counter()
    results = gather([model.capture(t, ["resid_post"], positions=positions) for t in batch])
    seconds = time.perf_counter() - started
    assert len(results) == len(batch) and all(len(r) == model.n_layers for r in results)
    return seconds, bytes_returned(model) - before


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = load_model(backend="vllm", max_model_len=256)
    batch = prompts(model, args.prompts)
    n_tokens = sum(t.shape[1] for t in batch)
    run(model, batch, None)  # warm-up
    times = {"all": [], "last": []}
    sent = {}
    ratios = []
    for _ in range(args.reps):
        order = ["all", "last"]
        random.shuffle(order)
        rep = {}
        for variant in order:
            seconds, nbytes = run(model, batch, None if variant == "all" else -1)
            times[variant].append(seconds)
            sent[variant] = nbytes
            rep[variant] = seconds
        ratios.append(rep["last"] / rep["all"])
    model.close()
    print(f"{args.prompts} prompts ({n_tokens} tokens), resid_post x {model.n_layers} layers, {args.reps} reps")
    print("| variant | median wall s | bytes returned |")
    print("| --- | --- | --- |")
    for variant in ("all", "last"):
        print(f"| `{variant}` | {statistics.median(times[variant]):.3f} | {sent[variant]:,} |")
    print(f"time last/all: {statistics.median(times['last']) / statistics.median(times['all']):.3f} (medians), "
          f"{statistics.median(ratios):.3f} (paired)")
    print(f"bytes last/all: {sent['last'] / sent['all']:.4f} (1/{sent['all'] / sent['last']:.1f}; "
          f"{args.prompts}/{n_tokens} = {args.prompts / n_tokens:.4f} positions)")


if __name__ == "__main__":
    main()
