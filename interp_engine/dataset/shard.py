"""One shard of an activation dataset: capture a fixed slice of prompts, write one Parquet file.

A shard is a pure function of its prompts and the dataset's settings, so a shard computed twice
(a replica died after writing, the driver was killed and the build rerun) is the same file.
Files are published atomically (:mod:`.store`): a shard file that exists is complete,
and its sha256 goes into the manifest (:mod:`.integrity`).

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
shard of this one, is told apart by :mod:`.integrity` whatever its manifest record says.

Tensor columns are nested fixed-size lists that every consumer reads, bf16 as exact float32
(see :mod:`.columns`); :func:`read_tensor` gives back torch tensors in the captured dtype.

A shard is captured (:func:`capture_shard`) and then written (:func:`write_captured`) in two
steps, so that a build writes one shard while the model captures the next
(:mod:`.writer`). A batched model (eager) captures a shard in padded batches of similar
lengths (:func:`~.batching.plan_batches`, at most ``ShardSpec.batch_tokens`` padded tokens
each); a one-prompt model (vLLM) gets every prompt of the shard in flight at once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from ..address import parse_address
from ..address import Address
from ..batching import join_rows, pad_positions, pad_tokens, plan_batches, run_padded
from ..cache import Cache
from ..features.plan import sparse_point
from ..features.sparse import SparseRows, per_prompt
from ..request import Points
from .columns import DTYPES, column_shape, read_tensor  # noqa: F401  (re-exported)
from .columns import IDENTITY_KEY, INDEX_KEY, encode, field_metadata, nested, write_bytes
from .names import shard_name as shard_name
from ..tokens import pad_batch

if TYPE_CHECKING:
    from .store import Store

LAYOUTS = ("sequence", "token")
#: padded tokens per forward of a batched model in a build: big enough to keep a CPU's or a
#: GPU's matmuls efficient, small enough that activations stay a few hundred MiB on 8B models
BATCH_TOKENS = 4096


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
    batch_tokens: int = BATCH_TOKENS  # padded tokens per forward of a batched model (plan_batches)
    writers: int = 1  # shards encoded, hashed and written at once beside the capture (dataset_writer)
    saes: tuple = ()  # dictionaries of the feature points (interp_engine.features)

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
    #: seconds spent on it: capture, encode (Arrow table and Parquet), hash, write (the store),
    #: waiting (for the model and for a writer); for the benchmark, never in the manifest
    times: dict = dataclasses.field(default_factory=dict, compare=False)

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


@dataclasses.dataclass
class Captured:
    """One shard's capture, not yet written: its padded tokens, the cache, its prompt ids."""

    index: int
    tokens: torch.Tensor
    cache: Cache
    ids: torch.Tensor
    seconds: float = 0.0


def capture_shard(model, spec: ShardSpec, index: int, texts: list[str]) -> Captured:
    """Capture the prompts of shard ``index`` (``texts``)."""
    start = time.perf_counter()
    rows = [model.tok.encode(t) for t in texts]
    tokens = pad_batch(rows)
    cache = _run_batches(model, tokens, Points.trusted(spec.points), spec.positions, spec.batch_tokens,
                         spec.saes or None)
    ids = torch.from_numpy(spec.prompt_ids(index, len(rows)).copy())
    return Captured(index, tokens, cache, ids, time.perf_counter() - start)


def _run_batches(model, tokens: torch.Tensor, addresses: list[Address], positions, batch_tokens: int,
                 saes=None) -> Cache:
    """The padded batch ``tokens`` captured in the batches :func:`plan_batches` cuts it into (a
    batched model; one batch is the whole batch as given, and a one-prompt model runs all rows in
    flight at once), joined back in the rows' order at the input's width."""
    lengths = (tokens >= 0).sum(dim=1).tolist()
    plan = plan_batches(lengths, batch_tokens) if model.batched else [list(range(len(lengths)))]
    if len(plan) == 1:
        return run_padded(model, tokens, addresses, positions, saes=saes)
    caches, parts = [], []
    for batch in plan:
        part = tokens[batch, :max(lengths[i] for i in batch)]
        caches.append(run_padded(model, part, addresses, positions, saes=saes))
        parts.append(part)
    held = None if positions is None else [c.positions for c in caches]
    joined, padded, held = join_rows([c.to_dict() for c in caches], parts, tokens.shape[1], held)
    back = torch.argsort(torch.tensor([i for batch in plan for i in batch]))  # the rows' own order
    return Cache({a: t[back] for a, t in joined.items()}, padded[back], None, model.name, model.backend,
                 None if held is None else held[back])


def shard_table(spec: ShardSpec, captured: Captured) -> tuple[pa.Table, int]:
    """The shard's Arrow table and its number of real tokens."""
    index, tokens, cache, ids = captured.index, captured.tokens, captured.cache, captured.ids
    addresses = [parse_address(p) for p in spec.points]
    lengths = (tokens >= 0).sum(dim=1)
    columns: dict[str, pa.Array] = {}
    fields: list[pa.Field] = []

    def add(name, array, metadata=None):
        columns[name] = array
        fields.append(pa.field(name, array.type, metadata=metadata))

    def add_tensor(name, tensor):
        array, dtype = encode(tensor, spec.dtype)
        add(name, nested(array), field_metadata(name, dtype, array.shape[1:]))

    def add_point(address, tensor, per_row: int | None = None):
        """A point's column: dense, or a dictionary's features as id and value lists per token
        (``per_row``: positions per row, the sequence layout)."""
        if not sparse_point(address):
            add_tensor(str(address), tensor)
            return
        rows = SparseRows.of(tensor)
        values, dtype = encode(rows.values, spec.dtype)
        ids, vals = rows.arrow(values)
        if per_row is not None:
            ids, vals = per_prompt(ids, per_row), per_prompt(vals, per_row)
        meta = field_metadata(str(address), dtype, (rows.width,))
        add(f"{address}.ids", ids, meta)
        add(f"{address}.values", vals, meta)

    if spec.layout == "sequence":
        add("prompt_index", pa.array(ids.numpy()))
        add("length", pa.array(lengths.numpy().astype(np.int32)))
        add("tokens", nested(pad_tokens(tokens, spec.max_length).numpy().astype(np.int32)))
        held = spec.held if cache.selected else None
        if held is not None:
            add("positions", nested(torch.nn.functional.pad(
                cache.positions, (0, held - cache.positions.shape[1]), value=-1).numpy().astype(np.int32)))
        for address in addresses:
            padded = pad_positions(cache[address], address, spec.max_length, held)
            add_point(address, padded, padded.shape[1])
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
            add_point(address, cache[address][b_idx, p_idx])
    schema = pa.schema(fields, metadata={IDENTITY_KEY: spec.metadata.encode(), INDEX_KEY: str(index).encode()})
    return pa.Table.from_arrays(list(columns.values()), schema=schema), int(lengths.sum())


def capture_table(model, spec: ShardSpec, index: int, texts: list[str]) -> tuple[pa.Table, int]:
    """The shard's Arrow table and its number of real tokens, captured and built in one call."""
    return shard_table(spec, capture_shard(model, spec, index, texts))


def write_captured(spec: ShardSpec, captured: Captured) -> ShardStats:
    """Encode, hash and publish a captured shard."""
    start = time.perf_counter()
    table, n_tokens = shard_table(spec, captured)
    data = shard_bytes(table)
    encoded = time.perf_counter()
    sha256 = hashlib.sha256(data).hexdigest()
    hashed = time.perf_counter()
    spec.store.write(spec.name(captured.index), data)
    times = {"capture": captured.seconds, "encode": encoded - start, "hash": hashed - encoded,
             "write": time.perf_counter() - hashed, "bytes": len(data)}
    return ShardStats(captured.index, len(captured.ids), n_tokens, table.num_rows, len(data), sha256, times=times)


def write_shard(model, spec: ShardSpec, index: int, texts: list[str]) -> ShardStats:
    """Capture ``texts`` (prompts ``index * shard_size ...``) and publish shard ``index``, one
    step after the other (a build overlaps them: :mod:`.writer`)."""
    return write_captured(spec, capture_shard(model, spec, index, texts))


def shard_bytes(table: pa.Table) -> bytes:
    """The Parquet file of one shard, in memory: hashed, then published in one write."""
    return write_bytes(table)


def read_json_metadata(schema: pa.Schema) -> dict:
    raw = (schema.metadata or {}).get(IDENTITY_KEY, b"{}")
    return json.loads(raw or b"{}")
