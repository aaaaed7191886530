"""How the vLLM capture cost grows with the work: the number of points, and the prompt length.

SmolLM2-135M (the embedded model) on the vLLM backend, all variants in this one process on one
engine, each repetition running every variant of a curve once in a shuffled order. Reported per
variant: the median wall and process CPU time, the median of the per-repetition ratios to the
curve's plain baseline, and the extra time per point or per position, so that a cost that grows
faster than the work shows as a growing per-unit number.

- ``points``: the generation workload of ``bench/vllm_capture.py`` (64 prompts, 32 new tokens,
  all in flight at once), capturing ``resid_post`` at 1, 8 and all 30 layers, every dense site
  at every layer (300 points), and ``logits`` (one vocabulary projection per position, which
  vLLM itself computes for the last position only), every position; baseline: vLLM's own
  ``LLM.generate`` on the same engine.
- ``positions``: prefill only (``await model.capture(tokens, points)``), ``resid_post`` at all 30
  layers, prompts of 16, 256 and 1,024 random tokens, as many prompts as fill the same token
  budget; baseline: ``LLM.generate`` of one token for the same prompts, not detokenized (what a
  prefill capture runs).

    .venv/bin/python bench/vllm_scaling.py [--reps 3] [--curve points|positions|both] [--budget 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import torch
from vllm_capture import SMOL, gather, plain_generate, prompts, timed

from interp_engine import Address, load_model

DENSE = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "z", "q", "k", "v", "mlp_post")


def capture(model, batch, points, new_tokens: int | None) -> int:
    """Every prompt of ``batch`` captured at once (a prefill when ``new_tokens`` is None); the
    bytes captured."""
    options = {} if new_tokens is None else {"max_tokens": new_tokens, "stop_at_eos": False}

    results = gather([model.capture(t, points, **options) for t in batch])
    extra = 0 if new_tokens is None else new_tokens - 1
    assert all(r[points[0]].shape[1] == t.shape[1] + extra for r, t in zip(results, batch))
    return sum(tensor.nbytes for r in results for tensor in r.values())


def measure(variants: dict, reps: int) -> dict[str, list[tuple[float, float]]]:
    times = {name: [] for name in variants}
    order = list(variants)
    for _ in range(reps):
        random.shuffle(order)
        for name in order:
            times[name].append(timed(variants[name]))
    return times


def report(title: str, times: dict, units: dict[str, int], unit: str, sizes: dict[str, int]) -> None:
    """One line per variant: medians, paired ratios to ``plain`` (and the CPU ratio of the fastest
    repetitions: interference from other tenants only adds time), extra CPU time per unit of work
    and per MiB captured."""
    print(f"\n{title}")
    print(f"{'variant':<22}{'wall s':>8}{'cpu s':>8}{'wall/plain':>12}{'cpu/plain':>11}{'fastest cpu':>13}"
          f"{'extra cpu ms/' + unit:>24}{'MiB':>9}{'extra cpu ms/MiB':>18}")
    for name, ts in times.items():
        base = times[plain_of(name)]
        wall = statistics.median(w / b for (w, _), (b, _) in zip(ts, base))
        cpu = statistics.median(c / b for (_, c), (_, b) in zip(ts, base))
        fastest = min(c for _, c in ts) / min(b for _, b in base)  # interference only adds time
        extra = statistics.median(c - b for (_, c), (_, b) in zip(ts, base))
        per = f"{1e3 * extra / units[name]:.3f}" if units.get(name) else ""
        mib = sizes.get(name, 0) / (1 << 20)
        per_mib = f"{1e3 * extra / mib:.2f}" if mib else ""
        mib = f"{mib:.1f}" if mib else ""
        print(f"{name:<22}{statistics.median(w for w, _ in ts):>8.2f}{statistics.median(c for _, c in ts):>8.2f}"
              f"{wall:>12.3f}{cpu:>11.3f}{fastest:>13.3f}{per:>24}{mib:>9}{per_mib:>18}")


def plain_of(name: str) -> str:
    """``capture@256`` -> ``plain@256``; every points variant -> ``plain``."""
    _, at, length = name.partition("@")
    return f"plain{at}{length}"


def points_curve(model, reps: int, new_tokens: int) -> None:
    batch = prompts(model, 64)
    layers = model.n_layers
    sets = {
        "resid_post x1": [Address("resid_post", layers // 2)],
        "resid_post x8": [Address("resid_post", layer) for layer in range(0, layers, max(1, layers // 8))][:8],
        f"resid_post x{layers}": [Address("resid_post", layer) for layer in range(layers)],
        f"dense x{layers}": [Address(s, layer) for layer in range(layers) for s in DENSE],
        "logits": [Address("logits")],
    }
    variants = {"plain": lambda: plain_generate(model, batch, new_tokens)}
    for name, points in sets.items():
        variants[name] = lambda points=points: capture(model, batch, points, new_tokens)
    sizes = {name: capture(model, batch, points, new_tokens) for name, points in sets.items()}
    times = measure(variants, reps)
    report(f"points: 64 prompts x {new_tokens} new tokens, every position", times,
           {name: len(points) for name, points in sets.items()}, "point", sizes)


def positions_curve(model, reps: int, budget: int) -> None:
    generator = torch.Generator().manual_seed(0)
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    variants, units = {}, {}
    for length in (16, 256, 1024):
        batch = [torch.randint(0, model.info.d_vocab, (1, length), generator=generator)
                 for _ in range(max(1, budget // length))]
        variants[f"plain@{length}"] = lambda batch=batch: plain_generate(model, batch, 1, detokenize=False)
        variants[f"capture@{length}"] = lambda batch=batch: capture(model, batch, points, None)
        units[f"capture@{length}"] = length * len(batch)
    sizes = {name: variants[name]() for name in units}
    times = measure(variants, reps)
    report(f"positions: prefill, resid_post x{model.n_layers}, {budget}-token budget per variant", times, units,
           "position", sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--curve", choices=("points", "positions", "both"), default="both")
    parser.add_argument("--budget", type=int, default=2048, help="prompt tokens per variant of the positions curve")
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = load_model(SMOL, backend="vllm", max_model_len=2048)
    print(f"{SMOL} on vLLM, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    capture(model, prompts(model, 4), [Address("resid_post", 0)], 4)  # first-call costs out of the way
    plain_generate(model, prompts(model, 4), 4)
    if args.curve in ("points", "both"):
        points_curve(model, args.reps, args.new)
    if args.curve in ("positions", "both"):
        positions_curve(model, args.reps, args.budget)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    model.close()


if __name__ == "__main__":
    main()
