"""Per-feature tallies over a stream of tokens, and their exact merge.

A dashboard build (:mod:`.dashboard`) cuts its prompts into shards and tallies each shard on its
own; the tallies merge into the same answer whatever the cut, in any order, so shards can be
computed anywhere, skipped on a resume and merged at the end:

- **stats** per feature: tokens it fires on, the sum and the max of its activations (sums and
  maxima merge);
- **top contexts**: the ``top_k`` largest activations, ties broken by (prompt, position) — the
  top ``k`` of a union is the top ``k`` of the parts' top ``k``;
- **samples**: a uniform sample of the tokens it fires on, the ``samples`` tokens of least hash
  of (dictionary, feature, prompt, position) — a bottom-``k`` sample, which merges the same way;
  sorted by activation they span its range (the dashboard's quantile samples, and the source of
  its activation quantiles).

Each chosen context carries a token window around it and the feature's activation at each
token of the window (``-1`` / ``0`` past either end of the prompt), so it can be shown without
the model.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from .sparse import SparseRows

STATS = ("dictionary", "feature", "n_fired", "total", "max")
CONTEXTS = ("dictionary", "feature", "kind", "activation", "prompt_index", "position", "hash", "window_start",
            "tokens", "acts")
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix(*columns: np.ndarray) -> np.ndarray:
    """A 64-bit hash of integer columns (splitmix64 over each in turn): deterministic everywhere."""
    h = np.zeros(len(columns[0]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in columns:
            h = (h ^ column.astype(np.uint64)) + np.uint64(0x9E3779B97F4A7C15)
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            h = h ^ (h >> np.uint64(31))
    return h & _MASK


def _first(groups: np.ndarray, k: int) -> np.ndarray:
    """Of rows sorted by group, the first ``k`` of each group (a boolean mask)."""
    if not len(groups):
        return np.zeros(0, dtype=bool)
    starts = np.r_[0, np.flatnonzero(groups[1:] != groups[:-1]) + 1]
    rank = np.arange(len(groups)) - np.repeat(starts, np.diff(np.r_[starts, len(groups)]))
    return rank < k


def tally(features: torch.Tensor, tokens: torch.Tensor, prompt_ids: torch.Tensor, dictionary: int, *,
          top_k: int, samples: int, window: tuple[int, int]) -> tuple[pa.Table, pa.Table]:
    """The stats and chosen contexts of one dictionary over one batch: ``features``
    ``[batch, pos, d_sae]``, ``tokens`` ``[batch, pos]`` (padding -1), ``prompt_ids`` ``[batch]``."""
    mask = tokens >= 0
    width = features.shape[-1]
    rows = SparseRows.of(features[mask]).cpu()
    b_idx, p_idx = (t.numpy() for t in mask.nonzero(as_tuple=True))
    token = np.repeat(np.arange(rows.n), rows.offsets.diff().numpy())
    feature = rows.ids.numpy().astype(np.int64)
    value = rows.values.float().numpy()
    n_fired = np.bincount(feature, minlength=width)
    total = np.bincount(feature, weights=value.astype(np.float64), minlength=width)
    peak = np.zeros(width, dtype=np.float32)
    np.maximum.at(peak, feature, value)
    fired = np.flatnonzero(n_fired)
    stats = pa.table({"dictionary": np.full(len(fired), dictionary, np.int32), "feature": fired.astype(np.int32),
                      "n_fired": n_fired[fired].astype(np.int64), "total": total[fired], "max": peak[fired]})
    prompt = prompt_ids.numpy()[b_idx[token]].astype(np.int64)
    position = p_idx[token].astype(np.int64)
    hashed = mix(np.full(len(feature), dictionary), feature, prompt, position)
    top = np.lexsort((position, prompt, -value, feature))
    top = top[_first(feature[top], top_k)]
    sample = np.lexsort((hashed, feature))
    sample = sample[_first(feature[sample], samples)]
    chosen = np.r_[top, sample]
    kinds = np.r_[np.zeros(len(top), np.int8), np.ones(len(sample), np.int8)]
    starts, ids, acts = _windows(features, tokens, b_idx[token[chosen]], position[chosen], feature[chosen], window)
    contexts = context_table(dictionary, feature[chosen], kinds, value[chosen], prompt[chosen], position[chosen],
                             hashed[chosen], starts, ids, acts)
    return stats, contexts


def _windows(features, tokens, rows, positions, feature, window):
    """Token ids and the feature's activations over ``[position - before, position + after]``."""
    before, after = window
    offsets = np.arange(-before, after + 1)
    at = positions[:, None] + offsets[None, :]
    lengths = (tokens >= 0).sum(dim=1).numpy()
    inside = (at >= 0) & (at < lengths[rows][:, None])
    clamped = torch.from_numpy(np.clip(at, 0, tokens.shape[1] - 1))
    r = torch.from_numpy(rows)[:, None]
    ids = torch.where(torch.from_numpy(inside), tokens[r, clamped], torch.full((), -1)).numpy().astype(np.int32)
    device = features.device  # the windows are gathered where the features are, then brought back
    acts = features[r.to(device), clamped.to(device), torch.from_numpy(feature)[:, None].to(device)].float().cpu()
    acts = torch.where(torch.from_numpy(inside), acts, torch.zeros(())).numpy()
    return (positions - before).astype(np.int32), ids, acts


def context_table(dictionary, feature, kind, activation, prompt, position, hashed, starts, ids, acts) -> pa.Table:
    n = len(feature)
    size = ids.shape[1] if ids.ndim == 2 else 0
    dictionary = np.broadcast_to(np.asarray(dictionary, np.int32), (n,))
    return pa.table({
        "dictionary": dictionary.astype(np.int32), "feature": np.asarray(feature, np.int32),
        "kind": np.asarray(kind, np.int8), "activation": np.asarray(activation, np.float32),
        "prompt_index": np.asarray(prompt, np.int64), "position": np.asarray(position, np.int32),
        "hash": np.asarray(hashed, np.uint64), "window_start": np.asarray(starts, np.int32),
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(ids).reshape(-1)), size),
        "acts": pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(acts, np.float32).reshape(-1)), size),
    })


def merge_stats(tables: list[pa.Table]) -> pa.Table:
    """Stats of the union: counts and sums added, maxima kept, per (dictionary, feature)."""
    table = pa.concat_tables(tables)
    if not table.num_rows:
        return table
    grouped = table.group_by(["dictionary", "feature"]).aggregate(
        [("n_fired", "sum"), ("total", "sum"), ("max", "max")])
    return grouped.rename_columns(["dictionary", "feature", "n_fired", "total", "max"])


def merge_contexts(tables: list[pa.Table], top_k: int, samples: int) -> pa.Table:
    """The chosen contexts of the union: per (dictionary, feature), the top ``top_k`` (activation
    descending, then prompt, then position) and the ``samples`` of least hash."""
    table = pa.concat_tables(tables)
    if not table.num_rows:
        return table
    d = table.column("dictionary").to_numpy()
    f = table.column("feature").to_numpy()
    kind = table.column("kind").to_numpy()
    group = d.astype(np.int64) << 32 | f.astype(np.int64)
    act = table.column("activation").to_numpy()
    prompt, position = table.column("prompt_index").to_numpy(), table.column("position").to_numpy()
    hashed = table.column("hash").to_numpy()
    top = np.flatnonzero(kind == 0)
    top = top[np.lexsort((position[top], prompt[top], -act[top], group[top]))]
    top = top[_first(group[top], top_k)]
    sample = np.flatnonzero(kind == 1)
    sample = sample[np.lexsort((hashed[sample], group[sample]))]
    sample = sample[_first(group[sample], samples)]
    return table.take(np.r_[top, sample])
