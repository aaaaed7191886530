"""How tensors are stored in a dataset's Parquet files, so that every consumer reads them.

A tensor column is a plain **nested fixed-size list** (``[rows, *shape]`` becomes
``fixed_size_list<fixed_size_list<float, d1>, d0>``): pyarrow, pandas, Ray Data, DuckDB,
polars and Hugging Face ``datasets`` (``with_format("torch")`` gives ``[rows, *shape]``
tensors) all read it without our code. (Arrow's ``fixed_shape_tensor`` extension, used before,
is rejected by HF ``datasets``.) Each field's metadata also records ``interp_engine.address``,
``interp_engine.dtype`` and ``interp_engine.shape``.

Values are ``float32`` or ``float16`` as captured. ``bfloat16``, which neither Arrow nor Parquet
has, is stored as the **float32 of each bf16 value**: exact (a bf16 is a float32 whose low 16
bits are zero), readable as float by everyone, marked ``interp_engine.dtype=bfloat16`` so
:func:`read_tensor` gives the bf16 tensor back bit for bit. On disk it costs no more than the raw
16-bit pattern: float32 columns are written with Parquet's ``BYTE_STREAM_SPLIT`` encoding, which
puts each byte position in its own stream, and zstd squeezes the two all-zero streams to
nothing. Measured on SmolLM2 ``resid_post.10`` (``bench/dataset_formats.py``), bytes per value:
bf16 as float32 1.05, bf16 as uint16 bits 1.05 (1.28 with zstd alone), float32 2.77 (5.12 with
zstd alone), float16 1.74. Readers that load bf16 columns get float32 in memory (4 bytes a
value); ours casts back to bf16. float16 columns keep Parquet's dictionary encoding, as DuckDB
reads ``BYTE_STREAM_SPLIT`` only for 4- and 8-byte types. Every data page carries a CRC32.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..dtypes import DTYPES as DTYPES
from ..dtypes import as_bfloat16, dtype_name

DTYPE_KEY = b"interp_engine.dtype"
ADDRESS_KEY = b"interp_engine.address"
SHAPE_KEY = b"interp_engine.shape"
IDENTITY_KEY = b"interp_engine.manifest"  # schema metadata: the manifest identity, as JSON
INDEX_KEY = b"interp_engine.shard"  # schema metadata: which shard the file is (format 3 on)


def encode(tensor: torch.Tensor, dtype: str) -> tuple[np.ndarray, str]:
    """A captured tensor as the numpy array to store, and the dtype it stands for."""
    tensor = tensor.detach().cpu()
    if not tensor.is_floating_point():
        return tensor.numpy(), dtype_name(tensor.dtype)
    tensor = tensor.to(DTYPES[dtype]).contiguous()
    if dtype == "bfloat16":
        return tensor.float().numpy(), dtype  # exact: bf16 -> f32 only appends zero bits
    return tensor.numpy(), dtype


def nested(array: np.ndarray) -> pa.Array:
    """``[rows, *shape]`` as nested fixed-size lists (a 1-d array stays a plain column)."""
    values = pa.array(np.ascontiguousarray(array).reshape(-1))
    for size in reversed(array.shape[1:]):
        values = pa.FixedSizeListArray.from_arrays(values, size)
    return values


def field_metadata(address: str, dtype: str, shape: tuple[int, ...]) -> dict[bytes, bytes]:
    return {ADDRESS_KEY: address.encode(), DTYPE_KEY: dtype.encode(), SHAPE_KEY: json.dumps(list(shape)).encode()}


def column_shape(schema: pa.Schema, name: str) -> tuple[int, ...]:
    """The per-row shape of column ``name``."""
    kind = schema.field(name).type
    if isinstance(kind, pa.FixedShapeTensorType):  # datasets written before format 2
        return tuple(kind.shape)
    shape = []
    while pa.types.is_fixed_size_list(kind):
        shape.append(kind.list_size)
        kind = kind.value_type
    return tuple(shape)


def _leaf(field: pa.Field) -> tuple[str, pa.DataType]:
    path, kind = field.name, field.type
    while pa.types.is_fixed_size_list(kind):
        path, kind = path + ".list.element", kind.value_type
    return path, kind


def write_options(schema: pa.Schema) -> dict:
    """``pq.write_table`` options: zstd, page CRCs, and per column the encoding measured best
    (``BYTE_STREAM_SPLIT`` for float32 leaves, bf16 included; the dictionary for the rest)."""
    split, dictionary = {}, []
    for field in schema:
        path, kind = _leaf(field)
        if kind == pa.float32():
            split[path] = "BYTE_STREAM_SPLIT"
        else:
            dictionary.append(path)
    return {"compression": "zstd", "write_page_checksum": True, "use_dictionary": dictionary,
            "column_encoding": split or None}


def to_numpy(column) -> np.ndarray:
    """A (chunked) nested fixed-size-list column as one ``[rows, *shape]`` numpy array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column, pa.FixedShapeTensorArray):
        return column.to_numpy_ndarray()
    shape = [len(column)]
    values = column
    while pa.types.is_fixed_size_list(values.type):
        shape.append(values.type.list_size)
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(shape)


def read_tensor(table: pa.Table, name: str) -> torch.Tensor:
    """Column ``name`` of a dataset table as one ``[rows, *shape]`` torch tensor in the dtype it
    was captured in (``bfloat16`` columns cast back from their exact float32 values)."""
    field = table.schema.field(name)
    tensor = torch.from_numpy(np.array(to_numpy(table.column(name)), copy=True))
    if (field.metadata or {}).get(DTYPE_KEY) == b"bfloat16":
        return as_bfloat16(tensor)  # format 1 stored the raw bit pattern, later formats the values
    return tensor


def write_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **write_options(table.schema))
    return sink.getvalue().to_pybytes()
