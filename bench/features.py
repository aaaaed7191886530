"""Features against activations (issue 24): what a sparse dictionary costs where it runs.

    .venv/bin/python bench/features.py [--parts capture dashboard] [--prompts 64] [--reps 5] [--json out.json]

SmolLM2-135M (the embedded model, fp32), prompts of 40-100 words, ``resid_post.15`` (d_model 576)
and a random TopK SAE on it with 16,384 features and k = 32 (random weights: the cost of the
maths and the bytes do not depend on what the features mean). Each part alternates its variants
in one process (``bench/timing.py``: every repetition runs each once, in a shuffled order) and
reports medians and the ratios of the medians, paired and fastest.

- ``capture`` (vLLM): ``await model.capture(...)`` of every prompt at once, prefill only:
  ``dense`` captures ``resid_post.15``; ``features`` captures ``resid_post.15.features`` with the
  SAE attached (encoded inside the worker, only the active features returned, densified to
  ``[1, pos, 16384]`` on the driver as a cache holds them). Bytes returned are what the worker
  handed to the driver (``interp_state``): expected to fall by about ``d_in * 4 / (k * 8)`` = 9x
  (plus 16 bytes per token of offsets and positions against the dense rows' 8).
- ``dashboard`` (eager): ``feature_dashboard`` of the SAE over the prompts (top 20, 20 samples,
  shards of 64) against ``build_dataset`` of ``resid_post.15`` in the token layout (the plain
  dataset build of the same activations): tokens/s of each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from build_throughput import loadavg, prompts  # noqa: E402
from timing import alternate, fastest, median, paired, ratio  # noqa: E402

LAYER, D_SAE, K = 15, 16384, 32


def random_sae(d_in: int = 576):
    from interp_engine import load_dictionary

    g = torch.Generator().manual_seed(0)
    weights = {"W_enc": torch.randn(d_in, D_SAE, generator=g) / d_in ** 0.5, "b_enc": torch.zeros(D_SAE),
               "W_dec": torch.randn(D_SAE, d_in, generator=g) / D_SAE ** 0.5, "b_dec": torch.zeros(d_in)}
    return load_dictionary(weights, reads=f"resid_post.{LAYER}", k=K, name="topk16k")


def summary(wall, cpu, base: str) -> dict:
    out = {"median_s": {k: median(v) for k, v in wall.items()}, "cpu_median_s": {k: median(v) for k, v in cpu.items()}}
    for name in wall:
        if name != base:
            out[f"{name}/{base}"] = {"medians": ratio(wall, name, base), "paired": paired(wall, name, base),
                                     "fastest": fastest(wall, name, base), "cpu": ratio(cpu, name, base)}
    return out


def capture_part(n: int, reps: int) -> dict:
    from vllm_capture import gather

    from interp_engine import load_model
    from interp_engine.backends.vllm.loop import run_on_loop

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = load_model(backend="vllm", max_model_len=256)
    sae = random_sae(model.d_model)
    batch = [model.to_tokens(t) for t in prompts(n)]
    tokens = sum(t.shape[1] for t in batch)
    sent: dict[str, list[int]] = {"dense": [], "features": []}

    def returned() -> int:
        return run_on_loop(model._loop, "interp_state")[0]["bytes_returned"]

    def variant(name, points, **kwargs):
        def run():
            before = returned()
            out = gather([model.capture(t, points, **kwargs) for t in batch])
            sent[name].append(returned() - before)
            return out
        return run

    runs = {"dense": variant("dense", [f"resid_post.{LAYER}"]),
            "features": variant("features", [f"resid_post.{LAYER}.features"], saes=sae)}
    print(f"capture: {n} prompts, {tokens} tokens, load {loadavg()}", flush=True)
    wall, cpu = alternate(runs, reps, warmup=1)
    model.close()
    dense, feats = median(sent["dense"][1:]), median(sent["features"][1:])
    return {"prompts": n, "tokens": tokens, **summary(wall, cpu, "dense"),
            "bytes": {"dense": dense, "features": feats, "features/dense": feats / dense,
                      "expected about": (K * 8 + 16) / (model.d_model * 4 + 8)},
            "load_after": loadavg()}


def dashboard_part(n: int, reps: int) -> dict:
    from interp_engine import build_dataset, feature_dashboard, load_model

    model = load_model()
    sae = random_sae(model.d_model)
    texts = prompts(n)
    work = Path(tempfile.mkdtemp(prefix="bench-features-"))
    tokens = {}

    def build():
        out = work / uuid.uuid4().hex[:8]
        ds = build_dataset(model, texts, [f"resid_post.{LAYER}"], out, layout="token", shard_size=64, progress=False)
        tokens["dataset"] = ds.tokens
        shutil.rmtree(out, ignore_errors=True)

    def dashboard():
        out = work / uuid.uuid4().hex[:8]
        dash = feature_dashboard(model, texts, [sae], out, top_k=20, samples=20, shard_size=64)
        tokens["dashboard"] = dash.tokens
        shutil.rmtree(out, ignore_errors=True)

    print(f"dashboard: {n} prompts, load {loadavg()}", flush=True)
    try:
        wall, cpu = alternate({"dataset": build, "dashboard": dashboard}, reps, warmup=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"prompts": n, "tokens": tokens["dataset"], **summary(wall, cpu, "dataset"), "load_after": loadavg()}
    out["tokens_per_s"] = {k: tokens["dataset"] / median(v) for k, v in wall.items()}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["capture", "dashboard"], choices=["capture", "dashboard"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = {}
    if "capture" in args.parts:
        results["capture"] = capture_part(args.prompts, args.reps)
        print(json.dumps(results["capture"], indent=1), flush=True)
    if "dashboard" in args.parts:
        results["dashboard"] = dashboard_part(args.prompts, args.reps)
        print(json.dumps(results["dashboard"], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
