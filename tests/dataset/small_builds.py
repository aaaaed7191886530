"""Small dataset builds the hostile-input and lease tests share: twelve prompts into shards of
four, and threads racing for one output's lease."""

from __future__ import annotations

import threading
import time

from interp_engine import DatasetBusyError, build_dataset
from interp_engine.dataset.lease import Lease

PROMPTS = [f"Note {i}: " + "folder lease shard " * (1 + i % 3) for i in range(12)]
POINTS = ["resid_post.1"]


def small_build(model, out, prompts=PROMPTS, points=POINTS, **kw):
    """``build_dataset`` of ``prompts`` into shards of 4, quietly."""
    return build_dataset(model, prompts, points, out, shard_size=4, progress=False, **kw)


def race(store, rounds: int, threads: int = 3) -> int:
    """Threads that claim ``store`` over and over; the most that ever held it at once."""
    holding, most, lock = [0], [0], threading.Lock()

    def claim():
        for _ in range(rounds):
            try:
                lease = Lease.acquire(store)
            except DatasetBusyError:
                time.sleep(0.005)
                continue
            with lock:
                holding[0] += 1
                most[0] = max(most[0], holding[0])
            time.sleep(0.01)
            with lock:
                holding[0] -= 1
            lease.release()

    workers = [threading.Thread(target=claim) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return most[0]
