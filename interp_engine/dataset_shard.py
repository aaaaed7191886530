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

With ``positions=`` (a selection of positions, see :mod:`interp_engine.positions`) only those
are captured: ``"token"`` has a row per kept position; ``"sequence"`` gets a ``positions``
column (``[held]``, -1 past a prompt's own selection) and tensor columns ``[held, ...]``, where
``held`` is the most positions the selection can keep in any prompt of the dataset.

Every file's schema metadata carries the manifest identity (``interp_engine.manifest``) and its
shard index (``interp_engine.shard``), so a file copied in from another dataset, or from another
shard of this one, is told apart by :mod:`.dataset_integrity` whatever its manifest record says.

Tensor columns are nested fixed-size lists that every consumer reads, bf16 as exact float32
(see :mod:`.dataset_columns`); :func:`read_tensor` gives back torch tensors in the captured dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from .address import parse_address
from .batching import pad_positions, pad_tokens, run_padded
from .dataset_columns import DTYPES, column_shape, read_tensor  # noqa: F401  (re-exported)
from .dataset_columns import IDENTITY_KEY, INDEX_KEY, encode, field_metadata, nested, write_bytes
from .dataset_names import shard_name as shard_name
from .tokens import pad_batch

if TYPE_CHECKING:
    from .dataset_store import Store

LAYOUTS = ("sequence", "token")


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
    positions: object = None  # a positions spec (None: every position)
    held: int = 0  # the width of a selection in the sequence layout
    n_prompts: int = 0
    shuffle_seed: int | None = None  # build-time shuffle (see :func:`prompt_order`)

    def order(self) -> "np.ndarray | None":
        """Which prompt goes where: ``None`` for prompt order, else a fixed permutation."""
        return None if self.shuffle_seed is None else prompt_order(self.shuffle_seed, self.n_prompts)

    def prompt_ids(self, index: int, count: int) -> np.ndarray:
        first = index * self.shard_size
        order = self.order()
        return np.arange(first, first + count, dtype=np.int64) if order is None else order[first:first + count]

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
    replica: int = -1  # which replica wrote it (-1: the driver's own model), and its process
    pid: int = 0

    def record(self) -> dict:
        """The manifest's record: what integrity checks use, and who wrote it."""
        rec = {"rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}
        return rec if self.replica < 0 else {**rec, "replica": self.replica, "pid": self.pid}


@functools.lru_cache(maxsize=4)
def prompt_order(seed: int, n_prompts: int) -> np.ndarray:
    """The build-time shuffle: shard ``i`` holds prompts ``order[i*shard_size : (i+1)*shard_size]``
    (a permutation fixed by the seed, so a rerun or resume writes the same files), and its token
    rows are permuted again with ``(seed, i)``."""
    order = np.random.default_rng([seed, n_prompts]).permutation(n_prompts).astype(np.int64)
    order.setflags(write=False)
    return order


def capture_table(model, spec: ShardSpec, index: int, texts: list[str]) -> tuple[pa.Table, int]:
    """The shard's Arrow table and its number of real tokens."""
    rows = [model.tok.encode(t) for t in texts]
    tokens = pad_batch(rows)
    addresses = [parse_address(p) for p in spec.points]
    cache = run_padded(model, tokens, addresses, spec.positions)
    ids = torch.from_numpy(spec.prompt_ids(index, len(rows)).copy())
    lengths = (tokens >= 0).sum(dim=1)
    columns: dict[str, pa.Array] = {}
    fields: list[pa.Field] = []

    def add(name, array, metadata=None):
        columns[name] = array
        fields.append(pa.field(name, array.type, metadata=metadata))

    def add_tensor(name, tensor):
        array, dtype = encode(tensor, spec.dtype)
        add(name, nested(array), field_metadata(name, dtype, array.shape[1:]))

    if spec.layout == "sequence":
        add("prompt_index", pa.array(ids.numpy()))
        add("length", pa.array(lengths.numpy().astype(np.int32)))
        add("tokens", nested(pad_tokens(tokens, spec.max_length).numpy().astype(np.int32)))
        held = spec.held if cache.selected else None
        if held is not None:
            add("positions", nested(torch.nn.functional.pad(
                cache.positions, (0, held - cache.positions.shape[1]), value=-1).numpy().astype(np.int32)))
        for address in addresses:
            add_tensor(str(address), pad_positions(cache[address], address, spec.max_length, held))
    else:
        mask = cache.mask
        b_idx, p_idx = mask.nonzero(as_tuple=True)  # p_idx: the column of the cache
        if spec.shuffle_seed is not None:  # mix the shard's tokens across its prompts
            rng = np.random.default_rng([spec.shuffle_seed, index])
            rows_order = torch.from_numpy(rng.permutation(len(b_idx)))
            b_idx, p_idx = b_idx[rows_order], p_idx[rows_order]
        at = cache.positions[b_idx, p_idx]  # the position each kept column holds
        add("prompt_index", pa.array(ids[b_idx].numpy()))
        add("position", pa.array(at.numpy().astype(np.int32)))
        add("token", pa.array(tokens[b_idx, at].numpy().astype(np.int32)))
        for address in addresses:
            add_tensor(str(address), cache[address][b_idx, p_idx])
    schema = pa.schema(fields, metadata={IDENTITY_KEY: spec.metadata.encode(), INDEX_KEY: str(index).encode()})
    return pa.Table.from_arrays(list(columns.values()), schema=schema), int(lengths.sum())


def write_shard(model, spec: ShardSpec, index: int, texts: list[str]) -> ShardStats:
    """Capture ``texts`` (prompts ``index * shard_size ...``) and publish shard ``index``."""
    table, n_tokens = capture_table(model, spec, index, texts)
    data = shard_bytes(table)
    spec.store.write(spec.name(index), data)
    return ShardStats(index, len(texts), n_tokens, table.num_rows, len(data), hashlib.sha256(data).hexdigest())


def shard_bytes(table: pa.Table) -> bytes:
    """The Parquet file of one shard, in memory: hashed, then published in one write."""
    return write_bytes(table)


def read_json_metadata(schema: pa.Schema) -> dict:
    raw = (schema.metadata or {}).get(IDENTITY_KEY, b"{}")
    return json.loads(raw or b"{}")
