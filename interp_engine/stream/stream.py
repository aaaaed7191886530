"""Activations straight into a trainer: a shuffled, resumable stream of token rows, no disk.

``activation_stream(model, prompts, points, batch_tokens=..., shuffle_buffer=..., seed=...)``
captures the prompts a chunk at a time (a chunk is a dataset build's shard, captured the same
way: :mod:`.rows`) and yields ``[batch_tokens, d]`` batches drawn at random from a bounded
pool of rows (:mod:`.buffer`). Each epoch visits the chunks in a fresh seeded order and yields
every row of every prompt exactly once: the multiset of an epoch's rows is the rows
``build_dataset(..., layout="token")`` writes for the same prompts and points.

Production runs ahead of the consumer by at most ``prefetch`` chunks (:mod:`.produce`): a
cluster model or a service connection captures that many chunks at once over its replicas; a
chunk's rows enter the pool only when its whole reply has arrived, in the epoch's chunk
order, so the stream is the same whatever replica answered or retried.

``stream.state()`` is a checkpoint of a few numbers (epoch, batches yielded, a fingerprint of the
settings); ``activation_stream(..., resume=state)`` replays the pool's draws on row keys alone
(no capture) and captures again only the chunks whose rows were still pooled, then continues
exactly where the first stream stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import numpy as np
import torch

from ..address import format_address
from ..dataset.prompts import PromptSource
from ..dataset.shard import BATCH_TOKENS, DTYPES, ShardSpec
from ..errors import InputError
from ..features.plan import check_saes
from ..positions import check_prompt, check_spec
from ..request import Points
from ..scalars import integer
from .buffer import ShuffleBuffer
from .produce import Producer, replicas
from .rows import capture_rows, chunk_keys, chunk_rows

STATE_FORMAT = 1


def activation_stream(model, prompts, points, *, batch_tokens: int, shuffle_buffer: int, seed: int = 0,
                      positions=None, saes=None, dtype: str | None = None, epochs: int = 1,
                      shard_size: int = 64, capture_tokens: int = BATCH_TOKENS, prefetch: int | None = None,
                      text_key: str = "text", progress: bool = True, resume: dict | None = None) -> "ActivationStream":
    """A stream of shuffled token rows of ``points`` over ``prompts`` (see the module docstring).

    ``batch_tokens``: rows per batch (an epoch's last batch may be smaller). ``shuffle_buffer``:
    rows pooled before drawing (at least ``batch_tokens``; memory is this many rows plus
    ``prefetch`` chunks). ``positions``, ``saes``, ``dtype``, ``shard_size``, ``text_key``: as in
    ``build_dataset`` (``capture_tokens`` is its ``batch_tokens``: padded tokens per forward).
    ``prefetch``: chunks captured ahead of the consumer (default: 1 on a local model, two per
    replica on a cluster or service). ``resume``: a ``stream.state()`` to continue from.
    """
    for name, value, low in (("batch_tokens", batch_tokens, 1), ("shuffle_buffer", shuffle_buffer, 1),
                             ("seed", seed, 0), ("epochs", epochs, 1), ("shard_size", shard_size, 1),
                             ("capture_tokens", capture_tokens, 1)):
        if integer(value) is None or integer(value) < low:
            raise InputError(f"{name} must be an int >= {low}, got {value!r}")
    batch_tokens, shuffle_buffer, seed, epochs, shard_size, capture_tokens = map(
        integer, (batch_tokens, shuffle_buffer, seed, epochs, shard_size, capture_tokens))
    if shuffle_buffer < batch_tokens:
        raise InputError(f"shuffle_buffer ({shuffle_buffer} rows) must hold at least one batch "
                         f"(batch_tokens={batch_tokens}); raise it, e.g. shuffle_buffer={8 * batch_tokens}")
    if prefetch is None:
        prefetch = 1 if replicas(model) is None else 2 * replicas(model)
    if integer(prefetch) is None or integer(prefetch) < 1:
        raise InputError(f"prefetch must be an int >= 1 (chunks captured ahead), got {prefetch!r}")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    stored = dtype or (model.dtype if model.dtype in DTYPES else "float32")
    addresses = Points.check(points, model.info, model.capabilities)
    wide = [a for a in addresses if len(a.position_axes) > 1]
    if wide:
        raise InputError(f"{wide[0].name!r} is [heads, q_pos, k_pos] and has no per-token row; stream a "
                         f"per-token point (resid_post, attn_out, mlp_out, ...)")
    dictionaries = check_saes(model, addresses, saes)
    selection = check_spec(positions)
    if selection == "generated":
        raise InputError("positions='generated' does not apply to a stream (it captures prompts only)")
    source = PromptSource.of(prompts, text_key)
    seen = iter(range(1 << 62))

    def encode(text):
        ids = model.tok.encode(text)
        check_prompt(selection, len(ids), f"prompt {next(seen)}")
        return ids

    scan = source.scan(encode, model.info.n_ctx, shard_size)
    n_chunks = -(-scan.count // shard_size)
    spec = ShardSpec(None, tuple(format_address(a) for a in addresses), "token", stored, scan.max_length,
                     n_chunks, shard_size, positions=selection, n_prompts=scan.count,
                     batch_tokens=capture_tokens, saes=dictionaries)
    settings = {"model": model.name, "points": list(spec.points), "prompts_sha256": scan.sha256,
                "positions": repr(selection), "saes": [repr(d) for d in dictionaries], "dtype": stored,
                "batch_tokens": batch_tokens, "shuffle_buffer": shuffle_buffer, "seed": seed, "epochs": epochs,
                "shard_size": shard_size, "capture_tokens": capture_tokens}
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    start = (0, 0)
    if resume is not None:
        start = _check_state(resume, fingerprint, epochs)
    lengths = np.frombuffer(scan.lengths, dtype=np.int32) if len(scan.lengths) else np.zeros(0, np.int32)
    return ActivationStream(model, source, spec, lengths, batch_tokens, shuffle_buffer, seed, epochs,
                            integer(prefetch), fingerprint, start, progress)


def _check_state(state, fingerprint: str, epochs: int) -> tuple[int, int]:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise InputError(f"resume must be a stream.state() (a dict with format {STATE_FORMAT}), got {state!r:.200}")
    if state.get("fingerprint") != fingerprint:
        raise InputError("resume: this state belongs to a stream with other settings (model, prompts, points, "
                         "positions, dtype, batch_tokens, shuffle_buffer, seed, epochs, shard_size or "
                         "capture_tokens differ); resume with the same arguments as the stream that made it")
    epoch, batches = state.get("epoch"), state.get("batches")
    if integer(epoch) is None or integer(batches) is None or not 0 <= integer(epoch) <= epochs or integer(batches) < 0:
        raise InputError(f"resume: epoch and batches must be ints within the stream, got {epoch!r}, {batches!r}")
    return integer(epoch), integer(batches)


class ActivationStream(torch.utils.data.IterableDataset):
    """An iterable of batches: a tensor ``[rows, d]``, or a dict of them by point when several
    points were asked for. Iterating again starts over from where the stream was created (its
    ``resume`` state, or the beginning). Use it in a ``DataLoader`` with ``batch_size=None`` and
    no worker processes (the stream batches and shuffles itself)."""

    def __init__(self, model, source, spec, lengths, batch, capacity, seed, epochs, prefetch, fingerprint, start,
                 progress):
        super().__init__()
        self.model, self.source, self.spec, self.lengths = model, source, spec, lengths
        self.batch, self.capacity, self.seed, self.epochs = batch, capacity, seed, epochs
        self.prefetch, self.fingerprint, self.start, self.progress = prefetch, fingerprint, start, progress
        self._position = start
        #: rows of each chunk (its keys are made when it is captured: a long stream keeps no key per row)
        self.chunk_rows = chunk_rows(spec, lengths)
        self.rows_per_epoch = int(self.chunk_rows.sum())

    def __len__(self) -> int:
        """Batches in all epochs (each epoch's last batch may be short)."""
        return -(-self.rows_per_epoch // self.batch) * self.epochs

    def state(self) -> dict:
        """A JSON-able checkpoint: resume with ``activation_stream(..., resume=state)``."""
        epoch, batches = self._position
        return {"format": STATE_FORMAT, "fingerprint": self.fingerprint, "epoch": epoch, "batches": batches}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The chunks of ``epoch`` in the order the stream captures them."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.spec.n_shards)

    def __iter__(self) -> Iterator:
        texts = None
        bar = self._bar()
        single = len(self.spec.points) == 1
        try:
            epoch, skip = self.start
            self._position = self.start
            while epoch < self.epochs:
                if texts is None:
                    texts = list(self.source)
                for values in self._epoch(epoch, skip, texts):
                    self._position = (epoch, self._position[1] + 1)
                    if bar is not None:
                        bar.update(len(next(iter(values.values()))))
                    yield values[self.spec.points[0]] if single else values
                epoch, skip = epoch + 1, 0
                self._position = (epoch, 0)
        finally:
            if bar is not None:
                bar.close()

    def _epoch(self, epoch: int, skip: int, texts: list[str]) -> Iterator[dict]:
        order = self.epoch_order(epoch)
        room = self.capacity + int(self.chunk_rows.max(initial=0))
        pool = ShuffleBuffer(self.capacity, self.batch, np.random.default_rng([self.seed, epoch, 1]), room)
        first = self._replay(pool, order, skip)
        spec, counts = self.spec, self.chunk_rows

        def job(i):
            return capture_rows(self.model, spec, i, _chunk_texts(texts, spec, i), chunk_keys(spec, self.lengths, i))

        held = [int(c) for c in pool.held_chunks()] if skip else []
        with Producer(job, self.prefetch, serial=replicas(self.model) is None) as producer:
            for position, values in producer.run(held):  # a resume: the pooled rows' chunks, captured again
                pool.fill(held[position], values)
            while pool.ready(draining=False):  # where the first stream stood: drawing, not inserting
                yield pool.draw()[1]
            for position, values in producer.run([int(c) for c in order[first:]]):
                chunk = int(order[first + position])
                pool.insert(chunk, int(counts[chunk]), values)
                while pool.ready(draining=False):
                    yield pool.draw()[1]
            while pool.ready(draining=True):
                yield pool.draw()[1]

    def _replay(self, pool: ShuffleBuffer, order: np.ndarray, skip: int) -> int:
        """Make the draws of the first ``skip`` batches on keys alone; the next chunk to capture."""
        done = drawn = 0
        while drawn < skip:
            if done < len(order) and not pool.ready(draining=False):
                pool.insert(int(order[done]), int(self.chunk_rows[int(order[done])]))
                done += 1
                continue
            if not pool.ready(draining=done == len(order)):
                raise InputError(f"resume: the state says {skip} batches of this epoch were yielded, more than the "
                                 f"epoch holds")
            pool.draw()
            drawn += 1
        return done

    def _bar(self):
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        total = self.rows_per_epoch * self.epochs
        done = min(total, self.start[0] * self.rows_per_epoch + self.start[1] * self.batch)
        return tqdm(total=total, initial=done, unit="row", desc="activation_stream", dynamic_ncols=True)


def _chunk_texts(texts: list[str], spec: ShardSpec, index: int) -> list[str]:
    return texts[index * spec.shard_size:(index + 1) * spec.shard_size]
