"""Eager capture overhead: ``run_with_cache`` vs a plain Hugging Face forward with no hooks.

SmolLM2-135M (the embedded model), a batch of 8 x 128 random token ids, on the CPU. Each
repetition times every variant once, in a shuffled order, in this one process; the report
gives each variant's median time and two ratios to the plain forward: the ratio of the medians,
and the median of the per-repetition ratios (each capture divided by the plain forward of the
same repetition), which is steadier when other work shares the machine.

Variants:

- ``plain``: ``model.hf(input_ids=ids)`` with transformers' own ``sdpa`` attention, no hooks,
  all logits — the baseline of the targets.
- ``plain_last``: the same with ``logits_to_keep=1``: the work a capture without ``logits`` does
  (the engine never computes the full logits unless asked), to separate hook overhead from the
  unembedding it skips.
- ``resid_post``: ``resid_post`` at every layer (target <= 1.03x plain).
- ``dense``: every dense site except ``pattern`` at every layer, plus ``logits`` (target
  <= 1.10x plain).
- ``pattern``: ``dense`` plus ``pattern`` at every layer. Forming the probabilities needs eager
  attention, so this is reported apart, beside ``plain_eager`` (HF's eager attention, no hooks).

    .venv/bin/python bench/eager_capture.py [--reps 5] [--batch 8] [--seq 128] [--threads N]
"""

from __future__ import annotations

import argparse

import torch
from timing import alternate, median, paired, ratio  # bench/timing.py, beside this file

from interp_engine import Address, load_model, run_with_cache
from interp_engine.backends.eager import attention

DENSE_SITES = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "q", "k", "v", "mlp_post"]


def variants(model, ids):
    layers = range(model.n_layers)
    resid = [Address("resid_post", L) for L in layers]
    dense = [Address(n, L) for n in DENSE_SITES for L in layers] + [Address("logits")]
    pattern = dense + [Address("pattern", L) for L in layers]

    def plain(implementation, **kwargs):
        def run():
            with attention.using(model.hf, implementation), torch.inference_mode():
                return model.hf(input_ids=ids, **kwargs).logits

        return run

    def capture(points):
        return lambda: run_with_cache(model, ids, points)

    return {
        "plain": plain("sdpa"),
        "plain_last": plain("sdpa", logits_to_keep=1),
        "plain_eager": plain("eager"),
        "resid_post": capture(resid),
        "dense": capture(dense),
        "pattern": capture(pattern),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of every variant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--only", nargs="*", help="run only these variants (plain is always run)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_model()
    generator = torch.Generator().manual_seed(0)
    # Ordinary ids (no specials): 3 .. vocab.
    ids = torch.randint(3, model.info.d_vocab, (args.batch, args.seq), generator=generator)
    runs = variants(model, ids)
    if args.only:
        runs = {k: v for k, v in runs.items() if k == "plain" or k in args.only}
    print(f"{model.name}: batch {args.batch} x {args.seq} tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.reps} reps (+{args.warmup} warm-up)")

    wall, cpu = alternate(runs, args.reps, args.warmup)
    report(wall, cpu)


def report(wall, cpu) -> None:
    targets = {"resid_post": "<= 1.03x", "dense": "<= 1.10x"}

    print("\nratios to `plain`: ratio of medians / median of paired (same-repetition) ratios")
    print("| variant | wall median s | wall ratio | wall paired | CPU median s | CPU ratio | CPU paired | target |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in wall:
        print(f"| {name} | {median(wall[name]):.3f} | {ratio(wall, name, 'plain'):.3f}x "
              f"| {paired(wall, name, 'plain'):.3f}x | {median(cpu[name]):.3f} | {ratio(cpu, name, 'plain'):.3f}x "
              f"| {paired(cpu, name, 'plain'):.3f}x | {targets.get(name, '')} |")
    for name, base in (("resid_post", "plain_last"), ("pattern", "plain_eager")):
        if name in wall and base in wall:
            print(f"{name} vs {base}: wall paired {paired(wall, name, base):.3f}x, "
                  f"CPU paired {paired(cpu, name, base):.3f}x")


if __name__ == "__main__":
    main()
