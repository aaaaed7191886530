"""An activation dataset as a Ray Dataset that reads while model replicas hold every CPU.

``ray.data.read_parquet`` plans a file-listing task that asks for a whole CPU, and its
``num_cpus=`` reaches only the read tasks: on a cluster whose CPUs are all held by replica
actors (2 CPUs, ``replicas=2``) it waits at ``ListFiles 0/1`` forever. The manifest already
lists every shard with its row count and size, so nothing needs listing: this module hands Ray
Data one read task per shard (a pyarrow read through the dataset's own filesystem) that
reserves ``num_cpus`` CPUs, 0 by default. Reading is I/O and decoding, light beside a replica.

A read that asks for CPUs the cluster does not have free is refused after ``wait_s`` seconds
with a :class:`~interp_engine.ClusterError` that names what holds them and how to proceed,
rather than left waiting.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .columns import to_numpy
from ..scalars import real


def to_ray(dataset, *, num_cpus: float = 0, wait_s: float = 30.0):
    import ray
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    if real(num_cpus) is None or not real(num_cpus) >= 0 or real(num_cpus) == float("inf"):
        from ..errors import InputError

        raise InputError(f"num_cpus must be a number >= 0 (CPUs reserved per read task), got {num_cpus!r}")
    num_cpus = real(num_cpus)
    if not ray.is_initialized():
        from ..loopback import connect

        connect()
    if num_cpus:
        _wait_for_cpus(num_cpus, wait_s)
    store = dataset._store
    records = dataset.manifest.get("shards") or {}
    names = dataset.names

    def read(key):
        return [as_tensors(pq.read_table(key, filesystem=store.fs))]

    class ShardSource(Datasource):
        def estimate_inmemory_data_size(self):
            return sum(r.get("bytes", 0) for r in records.values()) or None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            return [ReadTask(lambda key=store.key(name): read(key),
                             BlockMetadata(num_rows=records.get(name, {}).get("rows"),
                                           size_bytes=records.get(name, {}).get("bytes"), exec_stats=None,
                                           input_files=(store.location(name),)))
                    for name in names]

        def get_name(self):
            return "ActivationDataset"

    return ray.data.read_datasource(ShardSource(), num_cpus=num_cpus)


def as_tensors(table: pa.Table) -> pa.Table:
    """Nested fixed-size-list columns as Arrow tensor columns, which Ray Data hands out as numpy
    arrays of their shape (bf16 columns stay their exact float32 values)."""
    for i, field in enumerate(table.schema):
        if pa.types.is_fixed_size_list(field.type):
            array = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(to_numpy(table.column(i))))
            table = table.set_column(i, pa.field(field.name, array.type, metadata=field.metadata), array)
    return table


def _wait_for_cpus(num_cpus: float, wait_s: float) -> None:
    import ray

    from ..errors import ClusterError

    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= num_cpus:
            return
        if time.monotonic() >= deadline:
            total = ray.cluster_resources().get("CPU", 0.0)
            raise ClusterError(
                f"Ray Data read tasks asking for {num_cpus:g} CPU each cannot be scheduled: {free:g} of the "
                f"cluster's {total:g} CPUs have been free for the last {wait_s:g}s (model replicas and other actors "
                f"hold the rest). Read with to_ray(num_cpus=0) (the default), close the model first "
                f"(model.close()), or add CPUs to the cluster."
            )
        time.sleep(0.2)
