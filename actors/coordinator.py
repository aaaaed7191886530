"""The coordinator: shards work over the replicas and puts the results back together.

:class:`CoordinatorCore` is plain Python over an :class:`~.scheduler.Executor`, so the tests
drive it with in-process replicas; :func:`coordinator_actor` is the Ray shell, which plugs in
:class:`RayExecutor` (actor calls and ``ray.wait``).

- ``run``: a padded batch is cut into row shards (a row per shard for one-prompt backends, so
  vLLM replicas see each prompt at its true length; contiguous chunks for batched ones, at the
  batch's own width), run on the replicas, and joined back in input order at the input width.
- ``generate``: one prompt, on whichever replica is free (and another if that one dies).
- ``build``: dataset shards, written by the replicas; progress is read with ``progress``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from interp_engine import cancel
from interp_engine.batching import join_captured, split_with_edits
from interp_engine.errors import InternalError, user_error
from interp_engine.dataset.shard import ShardSpec, ShardStats

from .replica import ray_task_cancelled
from .scheduler import ReplicaDied, Scheduler, Shard
from interp_engine.wire import CaptureReply, GenerationReply


class CoordinatorCore:
    def __init__(self, executor, n_replicas: int, *, batched: bool, per_replica: int = 2,
                 names: dict[int, str] | None = None, max_attempts: int = 3):
        self.executor = executor
        self.replicas = list(range(n_replicas))
        self.batched = batched
        self.per_replica = per_replica
        self.names = names or {}
        self.max_attempts = max_attempts
        self._lock = threading.Lock()
        self._progress: dict[str, list[ShardStats]] = {}
        self._dead: set[int] = set()
        self.resubmitted = 0
        self.rejoined = 0

    def _scheduler(self, per_replica: int | None = None) -> Scheduler:
        with self._lock:
            live = [r for r in self.replicas if r not in self._dead]
        return Scheduler(self.executor, live, per_replica=per_replica or self.per_replica, names=self.names,
                         max_attempts=self.max_attempts)

    def _forget(self, scheduler: Scheduler) -> None:
        """Later calls skip replicas this call found dead."""
        with self._lock:
            self._dead |= set(scheduler.dead)
            self.resubmitted += scheduler.resubmitted
            self.rejoined += scheduler.rejoined

    def run(self, tokens: np.ndarray, points: list[str], positions=None, edits=None, saes=None) -> CaptureReply:
        tokens = np.asarray(tokens)
        shards = self._row_shards(tokens, list(points), positions, edits, saes)
        scheduler = self._scheduler()
        results: dict[int, CaptureReply] = {}
        try:
            for shard, captured in scheduler.run("run", shards):
                results[shard.index] = captured
        finally:
            self._forget(scheduler)
        return join_captured([results[i] for i in range(len(shards))], tokens, positions is not None)

    def _row_shards(self, tokens: np.ndarray, points: list[str], positions=None, edits=None,
                    saes=None) -> list[Shard]:
        """Row shards; each carries the positions spec and the edits (plain data, their positions
        specs as given), which every replica resolves per row (an edit's value per row cut with the
        piece's rows: :func:`~interp_engine.batching.split_with_edits`), and the call's dictionaries
        (``[(key, object ref)]``)."""
        return [Shard(i, (rows, points, positions, piece_edits, saes))
                for i, (rows, piece_edits) in enumerate(split_with_edits(tokens, self.batched, len(self.replicas),
                                                                          edits))]

    def generate(self, tokens: np.ndarray, points: list[str], options: dict, positions=None,
                 edits=None, saes=None) -> GenerationReply:
        scheduler = self._scheduler()
        try:
            shard = Shard(0, (tokens, points, options, positions, edits, saes))
            for _, generated in scheduler.run("generate", [shard]):
                return generated
        finally:
            self._forget(scheduler)
        raise InternalError("[Internal] the generate shard produced no result")

    def build(self, build_id: str, spec: ShardSpec, source, skip: set[int]) -> int:
        """Write every shard not in ``skip``; returns how many were written. ``progress(build_id)``
        lists the shards written so far."""
        shards = (Shard(index, (spec, index, texts)) for index, texts in source.shards(spec.shard_size, skip, spec.order()))
        # writers + 1 shards at each replica: it captures one while it writes the others
        scheduler = self._scheduler(max(self.per_replica, spec.writers + 1))
        written = 0
        with self._lock:
            self._progress[build_id] = []
        try:
            for _, stats in scheduler.run("write_shard", shards):
                with self._lock:
                    self._progress[build_id].append(stats)
                written += 1
        finally:
            self._forget(scheduler)
        return written

    def progress(self, build_id: str, since: int = 0) -> list[ShardStats]:
        with self._lock:
            return self._progress.get(build_id, [])[since:]

    def forget_build(self, build_id: str) -> None:
        with self._lock:
            self._progress.pop(build_id, None)


class RayExecutor:
    """Runs scheduler calls as Ray actor calls on the replica handles."""

    def __init__(self, handles: list):
        self.handles = handles

    def submit(self, replica: int, method: str, *args):
        return getattr(self.handles[replica], method).remote(*args)

    def wait(self, futures: list, timeout: float | None) -> list:
        import ray

        ready, _ = ray.wait(futures, num_returns=1, timeout=timeout)
        if ready:
            more, _ = ray.wait(futures, num_returns=len(futures), timeout=0)
            ready = list(dict.fromkeys(ready + more))
        return ready

    def result(self, future) -> Any:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError, TaskCancelledError

        try:
            return ray.get(future)
        except TaskCancelledError:  # ray.cancel of the request reached this call before it started
            raise cancel.Cancelled("the capture was cancelled by its caller before this replica ran it") from None
        except ActorUnavailableError as err:  # restarting (max_restarts): the new process takes later calls
            raise ReplicaDied(-1, type(err).__name__, restarting=True) from None
        except RayActorError as err:
            raise ReplicaDied(-1, type(err).__name__) from None  # the scheduler knows which replica
        except RayTaskError as err:
            raise user_error(err) from None


def coordinator_actor():
    """The Ray actor class around :class:`CoordinatorCore` (threaded: progress is read while a
    build runs, and async captures overlap)."""
    import ray

    @ray.remote(num_cpus=0, max_concurrency=64)
    class CoordinatorActor:
        def __init__(self, handles: list, batched: bool, per_replica: int, names: dict[int, str]):
            self.core = CoordinatorCore(RayExecutor(handles), len(handles), batched=batched,
                                        per_replica=per_replica, names=names)

        # A cancelled request (ray.cancel from the caller) stops scheduling here; Ray passes the
        # cancellation on to the replica calls it made, which stop between decode steps.
        def run(self, tokens, points, positions=None, edits=None, saes=None):
            with cancel.watching(ray_task_cancelled):
                return self.core.run(tokens, points, positions, edits, saes)

        def generate(self, tokens, points, options, positions=None, edits=None, saes=None):
            with cancel.watching(ray_task_cancelled):
                return self.core.generate(tokens, points, options, positions, edits, saes)

        def build(self, build_id, spec, source, skip):
            return self.core.build(build_id, spec, source, skip)

        def progress(self, build_id, since: int = 0):
            return self.core.progress(build_id, since)

        def forget_build(self, build_id):
            self.core.forget_build(build_id)

        def resubmitted(self) -> int:
            return self.core.resubmitted

        def rejoined(self) -> int:
            """How many times a replica that died came back (restarted by Ray) and got work again."""
            return self.core.rejoined

    return CoordinatorActor
