"""vLLM capture overhead against vLLM itself, on two workloads.

SmolLM2-135M (the embedded model), fp32, every engine with a 1 GiB KV cache
(``VLLM_CPU_KVCACHE_SPACE=1``; vLLM's own CPU default reserves 92 % of RAM). Each repetition runs
every variant once, in a shuffled order; the report gives each variant's median time and the
ratios that matter (median of per-repetition ratios; then the ratio of the medians and of the
fastest repetitions), for wall-clock time and, where the engine runs in this process, this
process's CPU time.

Workload ``generate``: 64 prompts of 5-16 tokens, 32 new tokens each (greedy, EOS ignored),
``resid_post`` at every layer at every position:

- ``default``: **vLLM with its own defaults**, ``LLM(model)`` in a process of its own (compiled
  graphs, prefix caching, chunked prefill: what a vLLM user runs), alternated with the others.
- ``default_eager`` (``--default-eager``): the same with ``enforce_eager=True``, in a process of
  its own too (what vLLM's compile buys, and what running the engine in this process costs).
- ``plain``: vLLM's ``LLM.generate`` on the very engine the capture uses, no points registered.
- ``plain_loop``: the same 64 requests, no points, posted through the backend's engine thread.
- ``capture``: ``await model.capture(tokens, points, max_tokens=32)`` for all 64 at once.
- ``eager``: the same 64 async captures on the eager backend (``--eager-reps``, before vLLM starts).

Workload ``prefix``: 64 requests that share a 512-token prefix plus 16 tokens of their own (a
fresh prefix each repetition, the same on every variant), one new token each:

- ``default``: vLLM with its own defaults, as above.
- ``plain_loop``: the requests through the backend's engine thread, nothing captured.
- ``capture``: ``await model.capture(tokens, ["resid_post.0"], positions=-1)`` for all 64 at once.

    .venv/bin/python bench/vllm_capture.py [--workload generate prefix] [--reps 5] [--eager-reps 1] [--default-eager]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
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
    from interp_engine.backends.vllm.sampling import sampling_params as _sampling_params
    from interp_engine.backends.vllm.loop import Job
    from interp_engine.model import Sampling

    params = _sampling_params(Sampling(max_tokens=new_tokens, stop_at_eos=False))
    futures = [model._loop.submit(Job(t[0].tolist(), params)) for t in batch]
    assert all(len(f.result().output.outputs[0].token_ids) == new_tokens for f in futures)


def prefix_batch(rep: int, n: int = 64, shared: int = 512, own: int = 16) -> list[torch.Tensor]:
    """``n`` prompts: a ``shared``-token prefix (fresh for each repetition) and ``own`` tokens each."""
    g = torch.Generator().manual_seed(rep)
    prefix = torch.randint(1000, 40000, (shared,), generator=g)
    return [torch.cat([prefix, torch.randint(1000, 40000, (own,), generator=g)])[None] for _ in range(n)]


def capture_prefix(model, batch):
    point = Address("resid_post", 0)
    results = gather([model.capture(t, [point], positions=-1) for t in batch])
    assert all(r[point].shape[1] == 1 for r in results)


class DefaultVllm:
    """vLLM with its own defaults (``LLM(model)``) in a process of its own (this script with
    ``--child``), running a workload when asked: one JSON line in, one ``RESULT`` line out."""

    def __init__(self, options: dict | None = None):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(options or {})],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self._read()  # started (and compiled)

    def run(self, batch: list[torch.Tensor], new_tokens: int) -> tuple[float, float]:
        self.proc.stdin.write(json.dumps({"prompts": [t[0].tolist() for t in batch], "new": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return tuple(self._read())

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"the default-vLLM process ended (exit code {self.proc.wait()})")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def child(options: dict) -> None:
    """``--child``: ``LLM(model, **options)``, vLLM's defaults unless ``options``; times ``generate``
    for each request line (wall; its CPU time is mostly in vLLM's engine-core process, so only
    wall is reported)."""
    from vllm import LLM, SamplingParams

    from interp_engine import embedded

    llm = LLM(model=str(embedded.ensure()), **options)
    print("RESULT " + json.dumps({"mode": str(llm.llm_engine.vllm_config.compilation_config.mode)}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(max_tokens=job["new"], temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        wall = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - wall
        assert all(len(o.outputs[0].token_ids) == job["new"] for o in outputs)
        print("RESULT " + json.dumps([wall, float("nan")]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", choices=("generate", "prefix"), default=["generate", "prefix"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--eager-reps", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--default-eager", action="store_true",
                        help="also vLLM's defaults but enforce_eager=True, in a process of its own "
                             "(what the compile buys)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(json.loads(args.child))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    eager = load_model(SMOL, backend="eager")
    batch = prompts(eager, args.prompts)
    points = [Address("resid_post", layer) for layer in range(eager.n_layers)]
    print(f"{SMOL}: generate: {len(batch)} prompts of {min(t.shape[1] for t in batch)}-"
          f"{max(t.shape[1] for t in batch)} tokens, {args.new} new tokens, resid_post at {len(points)} layers; "
          f"prefix: {args.prompts} x (512 shared + 16 own) tokens, 1 new token, resid_post.0 at the last position; "
          f"torch threads {torch.get_num_threads()}")
    times: dict[str, list[tuple[float, float]]] = {"eager": []}
    for _ in range(args.eager_reps if "generate" in args.workload else 0):
        times["eager"].append(timed(lambda: capture_all(eager, batch, points, args.new)))
    del eager

    default = DefaultVllm()
    default_eager = DefaultVllm({"enforce_eager": True}) if args.default_eager else None
    model = load_model(SMOL, backend="vllm")
    capture_all(model, batch[:4], points, 4)  # first-call costs out of the way
    plain_generate(model, batch[:4], 4)
    default.run(batch[:4], 4)
    if default_eager is not None:
        default_eager.run(batch[:4], 4)
    capture_prefix(model, prefix_batch(-1, 4))
    variants = {}
    if "generate" in args.workload:
        variants.update({
            "default": lambda rep: default.run(batch, args.new),
            "plain": lambda rep: timed(lambda: plain_generate(model, batch, args.new)),
            "plain_loop": lambda rep: timed(lambda: plain_loop(model, batch, args.new)),
            "capture": lambda rep: timed(lambda: capture_all(model, batch, points, args.new)),
        })
    if "prefix" in args.workload:
        shared = {rep: prefix_batch(rep, args.prompts) for rep in range(args.reps)}
        variants.update({
            "prefix_default": lambda rep: default.run(shared[rep], 1),
            "prefix_plain_loop": lambda rep: timed(lambda: plain_loop(model, shared[rep], 1)),
            "prefix_capture": lambda rep: timed(lambda: capture_prefix(model, shared[rep])),
        })
    if default_eager is not None:
        if "generate" in args.workload:
            variants["default_eager"] = lambda rep: default_eager.run(batch, args.new)
        if "prefix" in args.workload:
            variants["prefix_default_eager"] = lambda rep: default_eager.run(shared[rep], 1)
    for name in variants:
        times[name] = []
    order = list(variants)
    for rep in range(args.reps):  # every variant once per repetition, in a fresh order
        random.shuffle(order)
        for name in order:
            times[name].append(variants[name](rep))
    model.close()
    for process in (default, default_eager):
        if process is not None:
            process.close()
    report(times)


#: (variant, baseline, target) pairs the report gives when both ran
RATIOS = [
    ("capture", "default", "<= 1.05 (issue 42)"),
    ("plain_loop", "default", "<= 1.02 (issue 42)"),
    ("capture", "plain", "<= 1.05 wall, <= 1.03 cpu (issue 13)"),
    ("plain_loop", "plain", "<= 1.02 (the driver alone)"),
    ("capture", "plain_loop", ""),
    ("default", "default_eager", "(what vLLM's compile buys)"),
    ("plain", "default_eager", "(the same engine options, in this process / in its own)"),
    ("prefix_capture", "prefix_default", "<= 1.10 (issue 42)"),
    ("prefix_plain_loop", "prefix_default", "<= 1.02 (issue 42)"),
    ("prefix_capture", "prefix_plain_loop", ""),
    ("prefix_default", "prefix_default_eager", "(what vLLM's compile buys)"),
    ("prefix_plain_loop", "prefix_default_eager", ""),
]


def report(times: dict[str, list[tuple[float, float]]]) -> None:
    print(f"{'variant':<18}{'wall s':>8}{'cpu s':>8}   all runs, wall/cpu (s)")
    times = {name: ts for name, ts in times.items() if ts}  # --eager-reps 0 leaves eager out
    for name, ts in times.items():
        runs = " ".join(f"{w:.2f}/{c:.2f}" for w, c in ts)
        print(f"{name:<18}{statistics.median(w for w, _ in ts):>8.2f}{statistics.median(c for _, c in ts):>8.2f}"
              f"   {runs}")

    def ratio(a: str, b: str, i: int) -> str:
        if any(math.isnan(x[i]) for x in times[a] + times[b]):
            return "-"
        per_rep = statistics.median(x[i] / y[i] for x, y in zip(times[a], times[b]))
        of_medians = statistics.median(x[i] for x in times[a]) / statistics.median(y[i] for y in times[b])
        of_minimums = min(x[i] for x in times[a]) / min(y[i] for y in times[b])
        return f"{per_rep:.3f} ({of_medians:.3f}, {of_minimums:.3f})"

    # Other work on a shared machine only ever slows a repetition down, so the fastest repetition of
    # each variant is the steadiest estimate of its own cost when the spread is wide.
    print("ratios: median of per-repetition ratios (ratio of medians, ratio of fastest repetitions); "
          "wall clock, then process CPU time ('-': the default-vLLM process's CPU time is not measured)")
    for a, b, target in RATIOS:
        if a in times and b in times:
            aim = f"target {target}" if target else ""
            print(f"{a + ' / ' + b:<38} wall {ratio(a, b, 0)}  cpu {ratio(a, b, 1)}  {aim}")
    if "eager" in times and "capture" in times:
        eager_wall = statistics.median(w for w, _ in times["eager"])
        eager_cpu = statistics.median(c for _, c in times["eager"])
        wall, cpu = (statistics.median(t[i] for t in times["capture"]) for i in (0, 1))
        print(f"eager capture / vLLM capture   wall {eager_wall / wall:.2f}x  cpu {eager_cpu / cpu:.2f}x  "
              f"(vLLM faster when > 1)")


if __name__ == "__main__":
    main()
