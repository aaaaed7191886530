"""Writing shards beside the capture: the model never waits for Parquet, zstd, sha256 or the store.

A shard is captured by the model, then encoded (Arrow columns, Parquet with zstd), hashed and
published (:mod:`.shard`). The second half is CPU work that a GPU prefill outpaces,
and an upload to object storage is mostly waiting; done in series with the capture, it idles
the model for its whole duration. A :class:`ShardWriter` runs each shard as one call —
capture, then write — from several threads at once, so one shard is written while the next is
captured:

- **the model** is shared by those threads. A batched (eager) model runs one shard's capture
  at a time (``model_lock``: its batches one after another). A one-prompt model (vLLM) takes captures
  from every thread at once: its engine batches the requests of the shard being captured with
  those of the next (the engine's own continuous batching).
- **writers**: at most ``writers`` shards are encoded, hashed and written at once (a semaphore);
  more than one helps where one writer cannot keep up with the model (a GPU, a slow upload).
- **memory** stays flat: a build keeps at most ``writers + 1`` shards in flight
  (:func:`write_shards`), a replica as many as the coordinator sends it (``writers + 1``).

Shards are independent (a fixed name, atomic publish, a manifest record each), so the order in
which they finish changes nothing in the files: the same inputs give the same bytes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator

from .shard import ShardSpec, ShardStats, capture_shard, write_captured

#: the most writer threads a build may ask for (each holds a shard in memory)
MAX_WRITERS = 16


class ShardWriter:
    """Captures and writes shards of any build on ``model``, from any number of threads.

    ``model_lock``: the lock a shard's capture on a batched model takes (by default a new one);
    a one-prompt model needs none."""

    def __init__(self, model, model_lock: threading.Lock | None = None):
        self.model = model
        self.model_lock = model_lock or (threading.Lock() if model.batched else None)
        self._slots: dict[int, threading.Semaphore] = {}
        self._guard = threading.Lock()

    def _writers(self, n: int) -> threading.Semaphore:
        with self._guard:
            return self._slots.setdefault(n, threading.Semaphore(n))

    def write(self, spec: ShardSpec, index: int, texts: list[str]) -> ShardStats:
        """Capture shard ``index`` (waiting for the model if another capture holds it), then
        encode, hash and publish it (waiting for one of ``spec.writers`` writer slots)."""
        asked = time.perf_counter()
        with self.model_lock or contextlib.nullcontext():
            took = time.perf_counter()
            captured = capture_shard(self.model, spec, index, texts)
        waited = took - asked
        slots = self._writers(spec.writers)
        asked = time.perf_counter()
        with slots:
            waited += time.perf_counter() - asked
            stats = write_captured(spec, captured)
        return dataclasses.replace(stats, times={**stats.times, "waiting": waited})


def write_shards(writer: ShardWriter, spec: ShardSpec, shards: Iterable[tuple[int, list[str]]]) -> Iterator[ShardStats]:
    """Write every ``(index, texts)`` of ``shards`` through ``writer``, ``spec.writers + 1`` at
    once, yielding each shard's stats as it lands (in the order they land). Shards are pulled
    from ``shards`` only as slots free up. On an error the shards in flight finish (each is
    published whole or not at all), the rest are never started, and the error is raised."""
    width = spec.writers + 1
    source = iter(shards)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=width, thread_name_prefix="interp-shard")
    pending: set[concurrent.futures.Future] = set()
    try:
        exhausted = False
        while True:
            while not exhausted and len(pending) < width:
                item = next(source, None)
                if item is None:
                    exhausted = True
                else:
                    pending.add(pool.submit(writer.write, spec, *item))
            if not pending:
                return
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: f.exception() is None):  # an error first
                yield future.result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)  # nothing keeps running on the model after the build returns
