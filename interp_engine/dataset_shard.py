"""One shard of an activation dataset: capture a fixed slice of prompts, write one Parquet file.

A shard is a pure function of its prompts and the dataset's settings, so a shard computed twice
(a replica died after writing, the driver was killed and the build rerun) is the same file.
Files are written under a temporary name and renamed into place: a shard file that exists is
complete.

Layouts:

- ``"sequence"``: one row per prompt. Columns ``prompt_index``, ``length``, ``tokens``
  (``[max_length]``, right-padded with -1) and one tensor column per point,
  ``[max_length, ...]`` (``pattern``: ``[n_heads, max_length, max_length]``), zero where padded.
- ``"token"``: one row per real position. Columns ``prompt_index``, ``position``, ``token`` and
  one tensor column per point holding that position's ``[...]``.

With ``positions=`` (a selection of positions, see :mod:`interp_engine.positions`) only those
are captured: ``"token"`` has a row per kept position; ``"sequence"`` gets a ``positions``
column (``[held]``, -1 past a prompt's own selection) and tensor columns ``[held, ...]``, where
``held`` is the most positions the selection can keep in any prompt of the dataset.

Tensor columns are Arrow ``fixed_shape_tensor`` columns: pyarrow and Ray Data read them back
with their shapes; pandas sees flat arrays, reshaped with :func:`column_shape`. Floating points
are stored in the dataset's dtype; ``bfloat16``, which Arrow lacks, is stored as its raw 16-bit
pattern (``uint16``) and marked in the field metadata, so it is kept bit for bit;
:func:`read_tensor` turns any tensor column back into a torch tensor of the right dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .address import Address, parse_address
from .tokens import pad_batch

LAYOUTS = ("sequence", "token")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_KEY = b"interp_engine.dtype"
_ADDRESS_KEY = b"interp_engine.address"


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Everything a replica needs to write any shard of one dataset."""

    output: str
    points: tuple[str, ...]
    layout: str
    dtype: str
    max_length: int
    n_shards: int
    shard_size: int
    metadata: str = ""  # the manifest identity, embedded in every file's schema
    positions: object = None  # a positions spec (None: every position)
    held: int = 0  # the width of a selection in the sequence layout

    def path(self, index: int) -> Path:
        return Path(self.output) / shard_name(index, self.n_shards)


@dataclasses.dataclass(frozen=True)
class ShardStats:
    index: int
    prompts: int
    tokens: int
    rows: int
    bytes: int


def shard_name(index: int, n_shards: int) -> str:
    return f"part-{index:05d}-of-{n_shards:05d}.parquet"


def _run(model, tokens: torch.Tensor, addresses: list[Address], positions=None):
    from interp_engine.actors.batching import run_padded

    return run_padded(model, tokens, addresses, positions)


def capture_table(model, spec: ShardSpec, index: int, texts: list[str]) -> tuple[pa.Table, int]:
    """The shard's Arrow table and its number of real tokens."""
    rows = [model.tok.encode(t) for t in texts]
    tokens = pad_batch(rows)
    addresses = [parse_address(p) for p in spec.points]
    cache = _run(model, tokens, addresses, spec.positions)
    first = index * spec.shard_size
    lengths = (tokens >= 0).sum(dim=1)
    columns: dict[str, pa.Array] = {}
    fields: list[pa.Field] = []

    def add(name, array, metadata=None):
        columns[name] = array
        fields.append(pa.field(name, array.type, metadata=metadata))

    if spec.layout == "sequence":
        from interp_engine.actors.batching import pad_positions, pad_tokens

        add("prompt_index", pa.array(np.arange(first, first + len(rows), dtype=np.int64)))
        add("length", pa.array(lengths.numpy().astype(np.int32)))
        add("tokens", _tensor_array(pad_tokens(tokens, spec.max_length).numpy().astype(np.int32)))
        held = spec.held if cache.selected else None
        if held is not None:
            add("positions", _tensor_array(torch.nn.functional.pad(
                cache.positions, (0, held - cache.positions.shape[1]), value=-1).numpy().astype(np.int32)))
        for address in addresses:
            data = pad_positions(cache[address], address, spec.max_length, held)
            array, dtype = _encode(data, spec.dtype)
            add(str(address), _tensor_array(array), _meta(address, dtype))
    else:
        mask = cache.mask
        b_idx, p_idx = mask.nonzero(as_tuple=True)
        at = cache.positions[mask]  # the position each kept column holds
        add("prompt_index", pa.array((b_idx + first).numpy().astype(np.int64)))
        add("position", pa.array(at.numpy().astype(np.int32)))
        add("token", pa.array(tokens[b_idx, at].numpy().astype(np.int32)))
        for address in addresses:
            array, dtype = _encode(cache[address][mask], spec.dtype)
            add(str(address), _tensor_array(array), _meta(address, dtype))
    schema = pa.schema(fields, metadata={b"interp_engine.manifest": spec.metadata.encode()})
    return pa.Table.from_arrays(list(columns.values()), schema=schema), int(lengths.sum())


def write_shard(model, spec: ShardSpec, index: int, texts: list[str]) -> ShardStats:
    """Capture ``texts`` (prompts ``index * shard_size ...``) and write shard ``index``."""
    table, n_tokens = capture_table(model, spec, index, texts)
    final = spec.path(index)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return ShardStats(index, len(texts), n_tokens, table.num_rows, final.stat().st_size)


def _meta(address: Address, dtype: str) -> dict[bytes, bytes]:
    return {_ADDRESS_KEY: str(address).encode(), _DTYPE_KEY: dtype.encode()}


def _encode(tensor: torch.Tensor, dtype: str) -> tuple[np.ndarray, str]:
    tensor = tensor.detach().cpu()
    if not tensor.is_floating_point():
        return tensor.numpy(), str(tensor.dtype).removeprefix("torch.")
    tensor = tensor.to(DTYPES[dtype]).contiguous()
    if dtype == "bfloat16":
        return tensor.view(torch.int16).numpy().view(np.uint16), dtype
    return tensor.numpy(), dtype


def _tensor_array(array: np.ndarray) -> pa.Array:
    if array.ndim == 1:
        array = array[:, None]
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(array))


def column_shape(schema: pa.Schema, name: str) -> tuple[int, ...]:
    """The per-row shape of tensor column ``name`` (what pandas flattens)."""
    return tuple(schema.field(name).type.shape)


def read_tensor(table: pa.Table, name: str) -> torch.Tensor:
    """Column ``name`` of a dataset table as one ``[rows, *shape]`` torch tensor, in the dtype it
    was captured in (``bfloat16`` columns viewed back from their bit pattern)."""
    field = table.schema.field(name)
    column = table.column(name).combine_chunks()
    array = column.to_numpy_ndarray() if isinstance(column, pa.FixedShapeTensorArray) else column.to_numpy()
    tensor = torch.from_numpy(np.array(array, copy=True))
    if (field.metadata or {}).get(_DTYPE_KEY) == b"bfloat16":
        tensor = tensor.view(torch.int16).view(torch.bfloat16)
    return tensor


def read_json_metadata(schema: pa.Schema) -> dict:
    raw = (schema.metadata or {}).get(b"interp_engine.manifest", b"{}")
    return json.loads(raw or b"{}")
