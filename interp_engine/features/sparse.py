"""Feature activations stored sparse: for each token, the ids of its active features and their values.

A TopK or JumpReLU dictionary activates a handful of its thousands of features per token, so
what crosses a process boundary (a vLLM worker's reply) and what a dataset stores is the active
ones only, as compressed rows (CSR): ``offsets [n + 1]`` (token ``i`` owns entries
``offsets[i]:offsets[i + 1]``), ``ids`` (int32, ascending within a token) and ``values``. The
Parquet form is a list column of ids and one of values per token (a list of such lists per
prompt in the sequence layout), which pandas, DuckDB and Arrow read as they are.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import torch


@dataclasses.dataclass(frozen=True)
class SparseRows:
    """``n`` tokens' active features: ``offsets [n + 1]``, ``ids [nnz]`` (int32), ``values [nnz]``,
    over a dictionary of ``width`` features."""

    offsets: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor
    width: int

    @classmethod
    def of(cls, dense: torch.Tensor) -> "SparseRows":
        """The nonzero entries of ``dense`` ``[..., width]`` (leading axes flattened into tokens)."""
        flat = dense.detach().reshape(-1, dense.shape[-1])
        active = flat != 0
        counts = active.sum(dim=1)
        rows, ids = active.nonzero(as_tuple=True)
        offsets = torch.zeros(flat.shape[0] + 1, dtype=torch.int64, device=flat.device)
        offsets[1:] = counts.cumsum(0)
        return cls(offsets, ids.to(torch.int32), flat[rows, ids], int(dense.shape[-1]))

    @property
    def n(self) -> int:
        return self.offsets.shape[0] - 1

    def cpu(self) -> "SparseRows":
        return SparseRows(self.offsets.cpu(), self.ids.cpu(), self.values.cpu(), self.width)

    def dense(self, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """``[n, width]`` (or ``[*shape, width]``) with zeros where no feature is active."""
        out = torch.zeros(self.n, self.width, dtype=self.values.dtype, device=self.values.device)
        rows = torch.repeat_interleave(torch.arange(self.n, device=self.offsets.device), self.offsets.diff())
        out[rows, self.ids.long()] = self.values
        return out if shape is None else out.reshape(*shape, self.width)

    def arrow(self, values: np.ndarray | None = None) -> tuple[pa.Array, pa.Array]:
        """``(ids, values)`` as list columns, one list per token (``values``: already encoded
        values to store instead of ``self.values``)."""
        offsets = pa.array(self.offsets.numpy().astype(np.int32))
        vals = self.values.numpy() if values is None else values
        return (pa.ListArray.from_arrays(offsets, pa.array(self.ids.numpy())),
                pa.ListArray.from_arrays(offsets, pa.array(vals)))


def per_prompt(column: pa.Array, positions: int) -> pa.Array:
    """Token lists grouped ``positions`` at a time: a fixed-size list of lists per prompt."""
    return pa.FixedSizeListArray.from_arrays(column, positions)


def read_sparse(ids: pa.Array | pa.ChunkedArray, values: pa.Array | pa.ChunkedArray, width: int) -> SparseRows:
    """Token list columns (the sequence layout's per-prompt lists flattened) back as SparseRows."""
    ids, values = (c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in (ids, values))
    while pa.types.is_fixed_size_list(ids.type):
        ids, values = ids.flatten(), values.flatten()
    offsets = torch.from_numpy(ids.offsets.to_numpy().astype(np.int64))
    offsets = offsets - offsets[0]
    return SparseRows(offsets, torch.from_numpy(np.array(ids.flatten().to_numpy(), dtype=np.int32)),
                      torch.from_numpy(np.array(values.flatten().to_numpy(zero_copy_only=False), copy=True)), width)
