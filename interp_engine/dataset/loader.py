"""A streaming torch reader over a dataset's shards, for training probes and SAEs on data larger
than memory.

``dataset.loader(point, batch_size)`` is a ``torch.utils.data.IterableDataset`` of
``[batch_size, *shape]`` tensors of one point, one row per real token (``"token"`` layout rows;
the real positions of ``"sequence"`` layout rows). It reads one shard at a time, one column,
record batch by record batch, so memory is bounded by ``shuffle_buffer`` rows plus one record
batch however large the dataset is.

Shuffling (``shuffle=True``, ``seed=``): the shard order is permuted with the seed and the epoch,
and rows pass through a buffer of ``shuffle_buffer`` rows from which each output row is drawn at
random, so a batch mixes tokens of many sequences and shards. Distributed training: pass
``rank`` / ``world_size`` (default: ``torch.distributed`` if initialised) and each rank reads
its own shards (``shard % world_size == rank``); DataLoader workers split a rank's shards again.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from .columns import DTYPE_KEY, DTYPES, to_numpy
from ..dtypes import as_bfloat16
from ..errors import InputError
from ..scalars import integer

_READ_ROWS = 1024  # rows per record batch read from a shard


class ShardLoader(torch.utils.data.IterableDataset):
    def __init__(self, dataset, point: str, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 dtype=None, shuffle_buffer: int = 16384, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False):
        points = dataset.manifest["identity"]["points"]
        if point not in points:
            raise InputError(f"point {point!r} is not in this dataset; it holds {', '.join(points)}")
        if integer(batch_size) is None or integer(batch_size) < 1:
            raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
        batch_size = integer(batch_size)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            if dtype not in DTYPES:
                raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} or a torch dtype")
            dtype = DTYPES[dtype]
        if rank is None and world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.rank, self.world_size = rank or 0, world_size or 1
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.store = dataset._store
        self.names = dataset.names
        self.layout = dataset.manifest["identity"]["layout"]
        self.point, self.batch_size, self.shuffle, self.seed = point, batch_size, shuffle, seed
        self.dtype, self.buffer, self.drop_last = dtype, max(shuffle_buffer, batch_size), drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """A new shard order and shuffle for each epoch (as ``DistributedSampler.set_epoch``)."""
        self.epoch = epoch

    def _my_shards(self) -> list[str]:
        order = list(range(len(self.names)))
        if self.shuffle:
            np.random.default_rng([self.seed, self.epoch]).shuffle(order)
        mine = [self.names[i] for i in order if i % self.world_size == self.rank]
        worker = torch.utils.data.get_worker_info()
        return mine if worker is None else mine[worker.id::worker.num_workers]

    def _rows(self) -> Iterator[torch.Tensor]:
        """Blocks of rows ``[n, *shape]`` in the stored dtype, shard by shard."""
        columns = [self.point] + (["length"] if self.layout == "sequence" else [])
        for name in self._my_shards():
            with self.store.fs.open_input_file(self.store.key(name)) as f:
                reader = pq.ParquetFile(f)
                bf16 = (reader.schema_arrow.field(self.point).metadata or {}).get(DTYPE_KEY) == b"bfloat16"
                for batch in reader.iter_batches(batch_size=_READ_ROWS, columns=columns):
                    rows = torch.from_numpy(np.array(to_numpy(batch.column(self.point)), copy=True))
                    if self.layout == "sequence":  # keep the real positions only
                        lengths = torch.from_numpy(batch.column("length").to_numpy().astype(np.int64))
                        mask = torch.arange(rows.shape[1])[None, :] < lengths[:, None]
                        rows = rows[mask]
                    yield as_bfloat16(rows) if bf16 else rows

    def __iter__(self) -> Iterator[torch.Tensor]:
        rng = torch.Generator().manual_seed(hash((self.seed, self.epoch, self.rank)) & 0x7FFFFFFF)
        pending: list[torch.Tensor] = []
        held = 0
        for block in self._rows():
            pending.append(block)
            held += len(block)
            if held >= self.buffer:
                pool = torch.cat(pending)
                carry = 0
                if self.shuffle:  # half the buffer stays, to mix with the rows of the next blocks
                    pool = pool[torch.randperm(len(pool), generator=rng)]
                    carry = self.buffer // 2
                out = (len(pool) - carry) // self.batch_size * self.batch_size
                for start in range(0, out, self.batch_size):
                    yield self._cast(pool[start:start + self.batch_size])
                pending, held = [pool[out:]], len(pool) - out
        if held:
            pool = torch.cat(pending)
            if self.shuffle:
                pool = pool[torch.randperm(len(pool), generator=rng)]
            for start in range(0, len(pool), self.batch_size):
                batch = pool[start:start + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    yield self._cast(batch)

    def _cast(self, batch: torch.Tensor) -> torch.Tensor:
        return batch if self.dtype is None else batch.to(self.dtype)
