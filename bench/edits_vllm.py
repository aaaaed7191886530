"""Steering on the vLLM backend: generation time with edits against plain generation.

SmolLM2-135M (the embedded model), 64 prompts x 32 new tokens (greedy, ``ignore_eos``), all in
flight at once (``capture_generation_async``, sharing the engine's continuous batching), each
capturing only the last prompt token's logits (``positions=-1``: a call captures at least one point). Three variants on the same engine, side by side in each
repetition (shuffled order):

- ``plain``: no edit;
- ``one layer``: ``Add(vector, scale=4.0)`` at ``resid_post.15``, every position of every step;
- ``every layer``: the same at ``resid_post.L`` for all 30 layers.

The report gives median wall times and the median of the per-repetition ratios to ``plain``.

    .venv/bin/python bench/edits_vllm.py [--reps 5] [--prompts 64] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from vllm_capture import gather, prompts

from interp_engine import Add, load_model


def run(model, batch, edits, tokens: int) -> float:
    started = time.perf_counter()
    results = gather([model.capture_generation_async(t, ["logits"], max_tokens=tokens, positions=-1,
                                                     stop_at_eos=False, edits=edits) for t in batch])
    seconds = time.perf_counter() - started
    assert all(len(c.token_ids) == tokens for c, _ in results)
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = load_model(backend="vllm", max_model_len=256)
    batch = prompts(model, args.prompts)
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    variants = {
        "plain": None,
        "one layer": {"resid_post.15": Add(vector, scale=4.0)},
        "every layer": {f"resid_post.{layer}": Add(vector, scale=4.0) for layer in range(model.n_layers)},
    }
    run(model, batch, variants["one layer"], args.tokens)  # warm-up
    times = {name: [] for name in variants}
    ratios = {name: [] for name in variants}
    for _ in range(args.reps):
        order = list(variants)
        random.shuffle(order)
        rep = {name: run(model, batch, variants[name], args.tokens) for name in order}
        for name in variants:
            times[name].append(rep[name])
            ratios[name].append(rep[name] / rep["plain"])
    model.close()
    print(f"{args.prompts} prompts x {args.tokens} new tokens, SmolLM2 on vLLM, {args.reps} reps")
    print("| variant | median wall s | median ratio to plain |")
    print("| --- | --- | --- |")
    for name in variants:
        print(f"| `{name}` | {statistics.median(times[name]):.3f} | {statistics.median(ratios[name]):.3f} |")


if __name__ == "__main__":
    main()
