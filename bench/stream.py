"""Activation stream throughput: rows/s delivered to a trainer that does nothing, beside the same
model's plain prefill rate, and the stream's own cost per row on the consumer's side.

SmolLM2-135M (the embedded model) on the CPU, ``resid_post.15``, ``--prompts`` prompts of 20-60
tokens. Each repetition runs every variant once, in a shuffled order (bench/timing.py):

- ``prefill``: the chunks a stream captures (a dataset build's shards, its padded batches),
  captured one after another with ``capture_shard``: what any consumer of these activations pays.
- ``stream``: ``activation_stream`` over the same prompts, every batch taken and dropped
  (target: >= 0.9x the prefill rate with the model in this process).

``--overhead``: the consumer-side cost per row, in µs: the same stream with capture replaced by
ready-made rows (so only the shuffle pool, the chunk hand-over and the batching remain), over
``--overhead-rows`` rows of width 576 in float32.
``--replicas N``: the model on N replicas of a local Ray cluster (torch 1 thread each); the
prefill baseline is then the cluster's captures, ``prefetch`` chunks at once, in the stream's order.
``--rss``: a 10,000-prompt stream (capture replaced, as for ``--overhead``) taken by a slow
consumer: this process's peak RSS growth against the pool's bound.

    .venv/bin/python bench/stream.py [--reps 3] [--prompts 96] [--overhead] [--rss] [--replicas N]
"""

from __future__ import annotations

import argparse
import time

import torch
from rss import peak_rss_mb  # bench/rss.py, beside this file
from timing import alternate, median, paired, ratio  # bench/timing.py, beside this file

from interp_engine import activation_stream, load_model
from interp_engine.embedded import NAME
from interp_engine.examples.stream_sae import prompts as example_prompts
import interp_engine.stream.stream as stream_module
from interp_engine.stream.rows import chunk_keys

POINT = "resid_post.15"
SETTINGS = dict(batch_tokens=1024, shuffle_buffer=8192, seed=0, progress=False)


def prompts(n: int) -> list[str]:
    return [p * (1 + i % 3) for i, p in enumerate(example_prompts(n))]


def rows_of(stream) -> int:
    return sum(len(b) for b in stream)


def prefill(model, stream, prefetch: int):
    """The stream's captures alone, in its chunk order (``prefetch`` at once on a cluster)."""
    from interp_engine.stream.produce import Producer

    texts = list(stream.source)
    spec = stream.spec

    def job(i):
        return stream_module.capture_rows(model, spec, i, texts[i * spec.shard_size:(i + 1) * spec.shard_size],
                                          chunk_keys(spec, stream.lengths, i))

    def run():
        with Producer(job, prefetch, serial=prefetch == 1) as producer:
            return sum(len(v[POINT]) for _, v in producer.run([int(c) for c in stream.epoch_order(0)]))

    return run


def throughput(model, texts, reps: int, prefetch: int) -> None:
    stream = activation_stream(model, texts, [POINT], prefetch=prefetch, **SETTINGS)
    n = stream.rows_per_epoch
    wall, _ = alternate({"prefill": prefill(model, stream, prefetch), "stream": lambda: rows_of(stream)},
                        reps=reps, warmup=1)
    for name in ("prefill", "stream"):
        print(f"{name:8s} {n / median(wall[name]):9.0f} rows/s  (median {median(wall[name]):.2f} s, {n} rows)")
    print(f"stream / prefill rate: {1 / ratio(wall, 'stream', 'prefill'):.3f} (ratio of medians), "
          f"{1 / paired(wall, 'stream', 'prefill'):.3f} (paired)")


def ready_made(d: int):
    """A capture that costs nothing: rows of the right count, cut from one random block made once."""
    block = torch.randn(1 << 15, d)

    def capture(model, spec, index, texts, expected):
        return {p: block[:len(expected)] for p in spec.points}
    return capture


def overhead(model, rows: int, reps: int) -> None:
    real, stream_module.capture_rows = stream_module.capture_rows, ready_made(model.info.d_model)
    try:
        texts = prompts(max(1, rows // 60))
        stream = activation_stream(model, texts, [POINT], **SETTINGS)
        n = stream.rows_per_epoch
        times = []
        for rep in range(reps + 1):
            t = time.perf_counter()
            rows_of(stream)
            if rep:
                times.append(time.perf_counter() - t)
    finally:
        stream_module.capture_rows = real
    print(f"consumer-side overhead: {median(times) / n * 1e6:.2f} µs per row ({n} rows of width "
          f"{model.info.d_model} float32, median of {reps})")


def rss(model) -> None:
    real, stream_module.capture_rows = stream_module.capture_rows, ready_made(model.info.d_model)
    try:
        stream = activation_stream(model, prompts(10_000), [POINT], **SETTINGS)
        bound = (SETTINGS["shuffle_buffer"] + int(stream.chunk_rows.max()) * 2) * model.info.d_model * 4
        before = peak_rss_mb()
        for batch in stream:
            time.sleep(0.002)  # a slow trainer
            del batch
        grew = peak_rss_mb() - before
    finally:
        stream_module.capture_rows = real
    print(f"rss: 10,000 prompts, {stream.rows_per_epoch} rows ({stream.rows_per_epoch * model.info.d_model * 4 / 2**20:.0f} MiB "
          f"of activations): peak RSS grew {grew:.0f} MiB; the pool's bound is {bound / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--overhead-rows", type=int, default=200_000)
    parser.add_argument("--rss", action="store_true")
    args = parser.parse_args()
    kwargs = {} if not args.replicas else {"replicas": args.replicas, "torch_threads": 1}
    model = load_model(NAME, **kwargs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, replicas={args.replicas or 'local'}")
    try:
        if args.rss:
            rss(model)
        elif args.overhead:
            overhead(model, args.overhead_rows, args.reps)
        else:
            throughput(model, prompts(args.prompts), args.reps, 1 if not args.replicas else 2 * args.replicas)
    finally:
        getattr(model, "close", lambda: None)()


if __name__ == "__main__":
    main()
