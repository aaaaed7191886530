"""vLLM capture overhead, and the vLLM backend against the eager one, on one generation workload.

SmolLM2-135M (the embedded model), 64 prompts of different lengths, 32 new tokens each (greedy,
EOS ignored so every variant does the same work), ``resid_post`` at every layer at every
position. All variants run in this one process; the report gives each variant's median time
over the repetitions and the ratios that matter, measured side by side (each repetition runs
every vLLM variant once, in a shuffled order; the headline ratio is the median of the
per-repetition ratios, which is steadier when other work shares the machine). Each is given
for wall-clock time and for this process's CPU time (all threads; the TP=1 engine runs in this
process), which is less sensitive to other work on a shared machine:

- ``plain``: vLLM's own ``LLM.generate`` on the very engine the capture uses (so the engine
  arguments are identical), no points registered, so no hook installed.
- ``plain_loop``: the same 64 requests, no points, posted through the backend's engine thread
  (isolates the driver from the hooks).
- ``capture``: ``await model.capture(tokens, points, max_tokens=32)`` for all 64 prompts at once
  (``asyncio.gather``), sharing the engine's continuous batching. Target: <= 1.10x ``plain``.
- ``eager``: the same 64 async captures on the eager backend (one prompt at a time, KV cache).
  Measured first, before vLLM starts, with the machine's default torch threads (an in-process
  vLLM CPU worker pins torch to its own thread settings for the rest of the process).

    .venv/bin/python bench/vllm_capture.py [--reps 5] [--prompts 64] [--new 32] [--eager-reps 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

import torch

from interp_engine import Address, load_model

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SUBJECTS = ["The capital of France", "A good way to learn physics", "My favourite recipe for bread",
            "The history of the printing press", "Why the sky is blue", "How vaccines work",
            "The rules of chess", "A short poem about the sea"]


def prompts(model, n: int) -> list[torch.Tensor]:
    out = []
    for i in range(n):
        text = SUBJECTS[i % len(SUBJECTS)] + " is" + " really" * (i % 9) + ","
        out.append(model.to_tokens(text))
    return out


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


_LOOP = asyncio.new_event_loop()


def gather(awaitables) -> list:
    """Await all at once on one event loop kept for the whole benchmark. Not ``asyncio.run``: on
    Python 3.11 its exit formats the finished task's repr, result included (up to 24 tensors,
    printed in full when small), which cost 0.1-0.3 s per call here and is no part of a capture."""
    async def main():
        return await asyncio.gather(*awaitables)

    return _LOOP.run_until_complete(main())


def capture_all(model, batch, points, new_tokens):
    results = gather([model.capture(t, points, max_tokens=new_tokens, stop_at_eos=False) for t in batch])
    assert all(r[points[0]].shape[1] == t.shape[1] + new_tokens - 1 for r, t in zip(results, batch))
    return results


def plain_generate(model, batch, new_tokens, detokenize=True):
    """vLLM's own ``LLM.generate`` on the model's engine (``detokenize=False``: the work of a
    prefill-only capture, which throws its one sampled token away unread)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=detokenize)
    outputs = model.llm.generate([{"prompt_token_ids": t[0].tolist()} for t in batch], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)


def plain_loop(model, batch, new_tokens):
    # The backend's engine thread with jobs that register no points: plain generation through
    # the same driver the captures use (internal API, benchmark only).
    from interp_engine.backends.vllm.model import _sampling_params
    from interp_engine.backends.vllm.loop import Job
    from interp_engine.model import Sampling

    params = _sampling_params(Sampling(max_tokens=new_tokens, stop_at_eos=False))
    futures = [model._loop.submit(Job(t[0].tolist(), params)) for t in batch]
    assert all(len(f.result().output.outputs[0].token_ids) == new_tokens for f in futures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--eager-reps", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    eager = load_model(SMOL, backend="eager")
    batch = prompts(eager, args.prompts)
    points = [Address("resid_post", layer) for layer in range(eager.n_layers)]
    print(f"{SMOL}: {len(batch)} prompts of {min(t.shape[1] for t in batch)}-{max(t.shape[1] for t in batch)} "
          f"tokens, {args.new} new tokens, resid_post at {len(points)} layers; torch threads {torch.get_num_threads()}")
    times: dict[str, list[tuple[float, float]]] = {"eager": []}
    for _ in range(args.eager_reps):
        times["eager"].append(timed(lambda: capture_all(eager, batch, points, args.new)))
    del eager

    model = load_model(SMOL, backend="vllm", max_model_len=2048)
    capture_all(model, batch[:4], points, 4)  # first-call costs out of the way
    plain_generate(model, batch[:4], 4)
    variants = {
        "plain": lambda: plain_generate(model, batch, args.new),
        "plain_loop": lambda: plain_loop(model, batch, args.new),
        "capture": lambda: capture_all(model, batch, points, args.new),
    }
    for name in variants:
        times[name] = []
    order = list(variants)
    for _ in range(args.reps):  # every variant once per repetition, in a fresh order
        random.shuffle(order)
        for name in order:
            times[name].append(timed(variants[name]))
    model.close()
    report(times)


def report(times: dict[str, list[tuple[float, float]]]) -> None:
    print(f"{'variant':<12}{'wall s':>8}{'cpu s':>8}   all runs, wall/cpu (s)")
    times = {name: ts for name, ts in times.items() if ts}  # --eager-reps 0 leaves eager out
    for name, ts in times.items():
        runs = " ".join(f"{w:.2f}/{c:.2f}" for w, c in ts)
        print(f"{name:<12}{statistics.median(w for w, _ in ts):>8.2f}{statistics.median(c for _, c in ts):>8.2f}   {runs}")

    def ratio(a: str, b: str, i: int) -> str:
        per_rep = statistics.median(x[i] / y[i] for x, y in zip(times[a], times[b]))
        of_medians = statistics.median(x[i] for x in times[a]) / statistics.median(y[i] for y in times[b])
        of_minimums = min(x[i] for x in times[a]) / min(y[i] for y in times[b])
        return f"{per_rep:.3f} ({of_medians:.3f}, {of_minimums:.3f})"

    # Other work on a shared machine only ever slows a repetition down, so the fastest repetition of
    # each variant is the steadiest estimate of its own cost when the spread is wide.
    print("ratios: median of per-repetition ratios (ratio of medians, ratio of fastest repetitions); "
          "wall clock, then process CPU time")
    print(f"capture / plain vLLM generate  wall {ratio('capture', 'plain', 0)}  cpu {ratio('capture', 'plain', 1)}"
          f"  target <= 1.05 wall, <= 1.03 cpu")
    print(f"capture / plain through loop   wall {ratio('capture', 'plain_loop', 0)}  "
          f"cpu {ratio('capture', 'plain_loop', 1)}")
    print(f"plain through loop / plain     wall {ratio('plain_loop', 'plain', 0)}  "
          f"cpu {ratio('plain_loop', 'plain', 1)}  target <= 1.02 (the driver alone)")
    if "eager" not in times:
        return
    eager_wall = statistics.median(w for w, _ in times["eager"])
    eager_cpu = statistics.median(c for _, c in times["eager"])
    print(f"eager capture / vLLM capture   wall {eager_wall / statistics.median(w for w, _ in times['capture']):.2f}x  "
          f"cpu {eager_cpu / statistics.median(c for _, c in times['capture']):.2f}x  (vLLM faster when > 1)")


if __name__ == "__main__":
    main()
