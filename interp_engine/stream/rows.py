"""The rows of a stream: what one chunk of prompts yields, captured exactly as a dataset build
captures a shard (:func:`~interp_engine.dataset.shard.capture_shard`), in the ``"token"`` layout.

A chunk is a build's shard: prompts ``[i * shard_size, (i + 1) * shard_size)``, captured in the
same padded batches, so a stream's rows are bit for bit the rows ``build_dataset`` writes. Each
row's key is (prompt index, position); :func:`chunk_keys` predicts a chunk's keys from the
prompt lengths alone (no model), which is what lets a resume replay the shuffle on keys.
"""

from __future__ import annotations

import numpy as np
import torch

from ..address import parse_address
from ..dtypes import to_dtype
from ..errors import InternalError
from ..positions import resolve_row
from ..dataset.shard import ShardSpec, capture_shard


def chunk_keys(spec: ShardSpec, lengths: np.ndarray, index: int) -> np.ndarray:
    """``[rows, 2]``: (prompt index, position) of each row of chunk ``index``, in the order its
    capture gives them (prompt by prompt, positions ascending)."""
    ids = spec.prompt_ids(index, min(spec.shard_size, spec.n_prompts - index * spec.shard_size))
    parts = [np.stack([np.full(len(kept), i), np.asarray(kept, np.int64)], axis=1)
             for i in ids for kept in [resolve_row(spec.positions, int(lengths[i]))]]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 2), np.int64)


def chunk_rows(spec: ShardSpec, lengths: np.ndarray) -> np.ndarray:
    """The number of rows of every chunk, from the prompt lengths alone."""
    kept = lengths.astype(np.int64) if spec.positions is None else np.array(
        [len(resolve_row(spec.positions, int(n))) for n in lengths], np.int64)
    return np.add.reduceat(kept, np.arange(spec.n_shards) * spec.shard_size) if len(kept) else np.zeros(0, np.int64)


def capture_rows(model, spec: ShardSpec, index: int, texts: list[str], expected: np.ndarray) -> dict[str, torch.Tensor]:
    """Capture chunk ``index`` (``texts``) and return its rows per point, in ``expected``'s order."""
    captured = capture_shard(model, spec, index, texts)
    cache = captured.cache
    b_idx, p_idx = cache.mask.nonzero(as_tuple=True)
    keys = np.stack([captured.ids[b_idx].numpy(), cache.positions[b_idx, p_idx].numpy()], axis=1)
    if not np.array_equal(keys, expected):
        raise InternalError(f"[Internal] chunk {index}: the captured rows are not the (prompt, position) rows "
                            f"the stream planned ({len(keys)} vs {len(expected)} rows)")
    dtype = to_dtype(spec.dtype)
    return {p: cache[parse_address(p)][b_idx, p_idx].to(dtype) for p in spec.points}
