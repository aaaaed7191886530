"""Oracles for stream tests: a dataset build's rows read back with pyarrow, and multisets of rows."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import torch

from interp_engine import build_dataset
from interp_engine.dataset.shard import read_tensor


def built_rows(model, prompts, points, path, **kwargs) -> dict[str, np.ndarray]:
    """Per point, every row ``build_dataset(..., layout="token")`` writes (pyarrow, shard by shard)."""
    ds = build_dataset(model, prompts, points, path, layout="token", progress=False, **kwargs)
    out: dict[str, list] = {p: [] for p in points}
    for name in ds.manifest["result"]["files"]:
        table = pq.read_table(f"{ds.path}/{name}")
        for p in points:
            out[p].append(read_tensor(table, p).float().numpy())
    return {p: np.concatenate(v) for p, v in out.items()}


def joined(batches, points) -> np.ndarray:
    """The rows of ``batches`` (tensors, or dicts by point) as one ``[rows, sum d]`` array."""
    parts = [b if isinstance(b, dict) else {points[0]: b} for b in batches]
    return np.concatenate([np.concatenate([d[p].float().numpy() for p in points], axis=1) for d in parts])


def sorted_rows(rows: np.ndarray) -> np.ndarray:
    """The rows in one canonical order (lexicographic on their values): a multiset as an array."""
    return rows[np.lexsort(rows.T[::-1])]


def as_rows(built: dict[str, np.ndarray], points) -> np.ndarray:
    return np.concatenate([built[p] for p in points], axis=1)


def same_multiset(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(sorted_rows(a), sorted_rows(b))


__all__ = ["built_rows", "joined", "sorted_rows", "as_rows", "same_multiset", "torch"]
