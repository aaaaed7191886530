"""Capturing a stream's chunks ahead of its consumer, with back-pressure.

A :class:`Producer` runs chunk captures on a few threads: at most ``prefetch`` chunks are in
flight or finished-but-not-taken at any time, and a new one starts only when the consumer takes
one, so a slow trainer pauses the capture (the replicas idle) instead of growing memory. On a
cluster model or a service connection each capture is one of the model's own calls, split over
its replicas and retried by it when a replica dies; its rows are handed over only once the whole
reply has arrived, in the order the chunks were asked for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator


def replicas(model) -> int | None:
    """How many replicas serve ``model`` (``None``: a model in this process)."""
    count = getattr(model, "replicas", None)
    if isinstance(count, int):
        return count
    service = getattr(model, "service", None)
    return int(service.get("replicas", 1)) if isinstance(service, dict) else None


class Producer:
    """Runs ``job(chunk)`` for the chunks a stream asks for, ``prefetch`` at most at once.

    A model in this process is captured by one thread at a time (a lock); a remote one takes
    ``prefetch`` captures at once."""

    def __init__(self, job: Callable, prefetch: int, serial: bool):
        self.job, self.prefetch = job, prefetch
        self._lock = threading.Lock() if serial else contextlib.nullcontext()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="interp-stream")
        self._pending: collections.deque = collections.deque()
        self.peak_in_flight = 0

    def _run(self, chunk: int):
        with self._lock:
            return self.job(chunk)

    def run(self, chunks: Iterable[int]) -> Iterator[tuple[int, object]]:
        """``(i, rows)`` for the ``i``-th of ``chunks``, in order; each is asked for only when fewer
        than ``prefetch`` chunks are in flight or waiting to be taken."""
        source = iter(enumerate(chunks))
        exhausted = False
        while True:
            while not exhausted and len(self._pending) < self.prefetch:
                item = next(source, None)
                if item is None:
                    exhausted = True
                else:
                    self._pending.append((item[0], self._pool.submit(self._run, item[1])))
            self.peak_in_flight = max(self.peak_in_flight, len(self._pending))
            if not self._pending:
                return
            position, future = self._pending.popleft()
            yield position, future.result()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)  # nothing keeps running on the model once the stream stops
