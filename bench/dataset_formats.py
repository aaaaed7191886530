"""Benchmark: bytes per stored value of the Parquet encodings a dataset column could use.

    .venv/bin/python bench/dataset_formats.py [--prompts 24] [--point resid_post.10]

Captures one point of the embedded SmolLM2 over a few prompts (real activations: their value
distribution decides what compresses) and writes the token rows with each candidate encoding,
side by side: bf16 as its raw 16-bit pattern vs as exact float32 values, float32 and float16, each
with snappy / zstd and dictionary / BYTE_STREAM_SPLIT. Prints bytes per value and, for each, the
raw in-memory size for comparison. docs/CLUSTER.md "Storage format" states the choice made from it.
"""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def size(values: np.ndarray, compression: str, split: bool) -> int:
    width = values.shape[1]
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)
    sink = pa.BufferOutputStream()
    options = {"compression": compression}
    if split:
        options.update(use_dictionary=False, column_encoding={"x.list.element": "BYTE_STREAM_SPLIT"})
    pq.write_table(pa.table({"x": column}), sink, **options)
    return sink.getvalue().size


def main() -> None:
    from interp_engine import load_model, run_with_cache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--point", default="resid_post.10")
    args = parser.parse_args()
    model = load_model()
    texts = [f"Sentence {i} is about " + "the history of science and art " * (1 + i % 4) for i in range(args.prompts)]
    tokens = model.tok.to_tokens(texts)
    rows = run_with_cache(model, tokens, [args.point])[args.point][tokens >= 0]
    bf16 = rows.to(torch.bfloat16)
    candidates = {
        "bf16 as uint16 bits": bf16.view(torch.int16).numpy().view(np.uint16),
        "bf16 as exact float32": bf16.float().numpy(),
        "float32": rows.numpy(),
        "float16": rows.half().numpy(),
    }
    n = rows.numel()
    print(f"{args.point}: {rows.shape[0]} token rows x {rows.shape[1]} values of SmolLM2 ({n} values)")
    print(f"{'stored as':24} {'in memory':>10} {'snappy':>8} {'zstd':>8} {'zstd+BSS':>9}   (bytes/value)")
    for name, values in candidates.items():
        cells = [size(values, "snappy", False), size(values, "zstd", False), size(values, "zstd", True)]
        print(f"{name:24} {values.itemsize:>10} " + " ".join(f"{c / n:>8.3f}" for c in cells[:2])
              + f" {cells[2] / n:>9.3f}")


if __name__ == "__main__":
    main()
