"""One shard of an activation dataset: capture a fixed slice of prompts, write one Parquet file.

A shard is a pure function of its prompts and the dataset's settings, so a shard computed twice
(a replica died after writing, the driver was killed and the build rerun) is the same file.
Files are published atomically (:mod:`.dataset_store`): a shard file that exists is complete,
and its sha256 goes into the manifest (:mod:`.dataset_integrity`).

Layouts:

- ``"sequence"``: one row per prompt. Columns ``prompt_index``, ``length``, ``tokens``
  (``[max_length]``, right-padded with -1) and one tensor column per point,
  ``[max_length, ...]`` (``pattern``: ``[n_heads, max_length, max_length]``), zero where padded.
- ``"token"``: one row per real position. Columns ``prompt_index``, ``position``, ``token`` and
  one tensor column per point holding that position's ``[...]``.

Tensor columns are Arrow ``fixed_shape_tensor`` columns: pyarrow and Ray Data read them back
with their shapes; pandas sees flat arrays, reshaped with :func:`column_shape`. Floating points
are stored in the dataset's dtype; ``bfloat16``, which Arrow lacks, is stored as its raw 16-bit
pattern (``uint16``) and marked in the field metadata, so it is kept bit for bit;
:func:`read_tensor` turns any tensor column back into a torch tensor of the right dtype.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .address import Address, parse_address
from .tokens import pad_batch

if TYPE_CHECKING:
    from .dataset_store import Store

LAYOUTS = ("sequence", "token")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_KEY = b"interp_engine.dtype"
_ADDRESS_KEY = b"interp_engine.address"


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Everything a replica needs to write any shard of one dataset."""

    store: "Store"
    points: tuple[str, ...]
    layout: str
    dtype: str
    max_length: int
    n_shards: int
    shard_size: int
    metadata: str = ""  # the manifest identity, embedded in every file's schema

    def name(self, index: int) -> str:
        return shard_name(index, self.n_shards)


@dataclasses.dataclass(frozen=True)
class ShardStats:
    index: int
    prompts: int
    tokens: int
    rows: int
    bytes: int
    sha256: str = ""

    def record(self) -> dict:
        return {"rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}


def shard_name(index: int, n_shards: int) -> str:
    return f"part-{index:05d}-of-{n_shards:05d}.parquet"


def _run(model, tokens: torch.Tensor, addresses: list[Address]):
    from interp_engine.actors.batching import run_padded

    return run_padded(model, tokens, addresses)


def capture_table(model, spec: ShardSpec, index: int, texts: list[str]) -> tuple[pa.Table, int]:
    """The shard's Arrow table and its number of real tokens."""
    rows = [model.tok.encode(t) for t in texts]
    tokens = pad_batch(rows)
    addresses = [parse_address(p) for p in spec.points]
    cache = _run(model, tokens, addresses)
    first = index * spec.shard_size
    lengths = cache.mask.sum(dim=1)
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
        for address in addresses:
            data = pad_positions(cache[address], address, spec.max_length)
            array, dtype = _encode(data, spec.dtype)
            add(str(address), _tensor_array(array), _meta(address, dtype))
    else:
        mask = cache.mask
        b_idx, p_idx = mask.nonzero(as_tuple=True)
        add("prompt_index", pa.array((b_idx + first).numpy().astype(np.int64)))
        add("position", pa.array(p_idx.numpy().astype(np.int32)))
        add("token", pa.array(tokens[mask].numpy().astype(np.int32)))
        for address in addresses:
            array, dtype = _encode(cache[address][mask], spec.dtype)
            add(str(address), _tensor_array(array), _meta(address, dtype))
    schema = pa.schema(fields, metadata={b"interp_engine.manifest": spec.metadata.encode()})
    return pa.Table.from_arrays(list(columns.values()), schema=schema), int(lengths.sum())


def write_shard(model, spec: ShardSpec, index: int, texts: list[str]) -> ShardStats:
    """Capture ``texts`` (prompts ``index * shard_size ...``) and publish shard ``index``."""
    table, n_tokens = capture_table(model, spec, index, texts)
    data = shard_bytes(table)
    spec.store.write(spec.name(index), data)
    return ShardStats(index, len(texts), n_tokens, table.num_rows, len(data), hashlib.sha256(data).hexdigest())


def shard_bytes(table: pa.Table) -> bytes:
    """The Parquet file of one shard, in memory: hashed, then published in one write. Every data
    page carries a CRC32, so a reader with page verification on catches flipped bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    return sink.getvalue().to_pybytes()


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
