"""The shuffle buffer of an activation stream: a bounded pool of rows, drawn from at random.

Rows enter a chunk at a time (one chunk: the rows of a few prompts, whole); once the pool holds
``capacity`` rows, every batch is ``batch`` rows drawn from it without replacement, and the
holes are filled from the pool's tail, so the pool stays one contiguous block. What it draws
depends only on its seed and the chunks it was given, never on what the rows hold: the same
buffer run on the rows' *keys* alone (``values=None``) makes the same draws, which is how a
stream resumes from a checkpoint that stores only a count of batches (:mod:`.stream`).
"""

from __future__ import annotations

import numpy as np
import torch


class ShuffleBuffer:
    """At most ``capacity + largest_chunk`` rows, each a key (chunk, row in chunk) and, unless
    the buffer only replays draws, its values (a tensor per point)."""

    def __init__(self, capacity: int, batch: int, rng: np.random.Generator, room: int):
        self.capacity, self.batch, self.rng = capacity, batch, rng
        self.chunk = np.zeros(room, np.int64)
        self.row = np.zeros(room, np.int64)
        self.values: dict[str, torch.Tensor] | None = None
        self.room = room
        self.n = 0

    def insert(self, chunk: int, count: int, values: dict[str, torch.Tensor] | None = None) -> None:
        """Add the ``count`` rows of ``chunk`` (their values, when this buffer holds them)."""
        end = self.n + count
        if end > self.room:
            raise AssertionError(f"[Internal] shuffle buffer overflow: {end} rows > room {self.room}")
        self.chunk[self.n:end] = chunk
        self.row[self.n:end] = np.arange(count)
        if values is not None:
            if self.values is None:
                self.values = {k: torch.empty((self.room, *v.shape[1:]), dtype=v.dtype) for k, v in values.items()}
            for k, v in values.items():
                self.values[k][self.n:end] = v
        self.n = end

    def ready(self, draining: bool) -> bool:
        """Whether a batch is due: the pool is full, or the epoch's rows are all in and some remain."""
        return self.n > 0 if draining else self.n >= self.capacity

    def draw(self) -> tuple[np.ndarray, dict[str, torch.Tensor] | None]:
        """Take one batch (``min(batch, n)`` rows) at random: their keys ``[k, 2]`` and values."""
        k = min(self.batch, self.n)
        picked = self.rng.choice(self.n, size=k, replace=False) if k < self.n else self.rng.permutation(self.n)
        keys = np.stack([self.chunk[picked], self.row[picked]], axis=1)
        out = None
        if self.values is not None:
            index = torch.from_numpy(picked)
            out = {name: v.index_select(0, index) for name, v in self.values.items()}
        self._compact(picked)
        return keys, out

    def _compact(self, picked: np.ndarray) -> None:
        """Fill the holes the draw left below the new end with the tail's remaining rows."""
        end = self.n - len(picked)
        taken = np.zeros(self.n - end, bool)
        tail = picked[picked >= end] - end
        taken[tail] = True
        holes = np.sort(picked[picked < end])
        movers = np.nonzero(~taken)[0] + end
        self.chunk[holes] = self.chunk[movers]
        self.row[holes] = self.row[movers]
        if self.values is not None and len(holes):
            h, m = torch.from_numpy(holes), torch.from_numpy(movers)
            for v in self.values.values():
                v[h] = v[m]
        self.n = end

    def held_chunks(self) -> np.ndarray:
        """The chunks with rows still in the pool (a resume captures them again)."""
        return np.unique(self.chunk[:self.n])

    def fill(self, chunk: int, values: dict[str, torch.Tensor]) -> None:
        """Give the pool's rows of ``chunk`` their values (after a replay on keys alone)."""
        slots = np.nonzero(self.chunk[:self.n] == chunk)[0]
        if self.values is None:
            self.values = {k: torch.empty((self.room, *v.shape[1:]), dtype=v.dtype) for k, v in values.items()}
        s, r = torch.from_numpy(slots), torch.from_numpy(self.row[slots])
        for k, v in values.items():
            self.values[k][s] = v.index_select(0, r)
