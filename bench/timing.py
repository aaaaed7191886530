"""What the side-by-side benchmarks share: time one call, alternate variants, summarise.

Every repetition runs every variant once, in an order shuffled anew each repetition, so slow
phases of a shared machine fall on all variants alike. A variant's time is its median over the
repetitions; a ratio is given two ways: the ratio of the medians, and the median of the
per-repetition ("paired") ratios, which is steadier when other processes share the cores. CPU
time is this process's CPU seconds (all threads), which contention inflates far less than wall
time.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

Times = dict[str, list[float]]


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call; its result is dropped."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    del out
    return wall, cpu


def alternate(runs: dict[str, Callable[[], object]], reps: int, warmup: int, seed: int = 0,
              groups: list[list[str]] | None = None) -> tuple[Times, Times]:
    """Wall and CPU times of each variant over ``reps`` repetitions after ``warmup`` untimed ones.

    With ``groups`` (lists of variant names covering ``runs``), each group's variants run one
    after another, the groups and the variants within each shuffled anew every repetition, so a
    variant and the baseline of its group are timed close together.
    """
    groups = [list(g) for g in groups] if groups else [list(runs)]
    assert sorted(n for g in groups for n in g) == sorted(runs), "groups must cover the variants once"
    rng = random.Random(seed)
    wall: Times = {k: [] for k in runs}
    cpu: Times = {k: [] for k in runs}
    for rep in range(warmup + reps):
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
        row = {name: timed(runs[name]) for group in groups for name in group}
        if rep >= warmup:
            for name, (w, c) in row.items():
                wall[name].append(w)
                cpu[name].append(c)
        print(f"  rep {rep}{' (warm-up)' if rep < warmup else ''} wall/cpu s: "
              + " ".join(f"{k}={row[k][0]:.2f}/{row[k][1]:.2f}" for k in runs), flush=True)
    return wall, cpu


def median(values) -> float:
    return statistics.median(values)


def ratio(times: Times, name: str, base: str) -> float:
    """Ratio of the medians."""
    return median(times[name]) / median(times[base])


def paired(times: Times, name: str, base: str) -> float:
    """Median of the per-repetition ratios."""
    return median(t / b for t, b in zip(times[name], times[base]))


def fastest(times: Times, name: str, base: str) -> float:
    """Ratio of the minimums: other processes only ever add time, so on a busy machine the
    fastest repetition of each variant is the one least disturbed."""
    return min(times[name]) / min(times[base])
