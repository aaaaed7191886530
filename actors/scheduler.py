"""Sharded work over replicas: bounded in flight, failover, exactly-once results.

A :class:`Scheduler` takes an iterable of :class:`Shard`\\ s and a set of replicas and yields
``(shard, result)`` once per shard id. It pulls shards from the iterable only when a replica
slot is free, so memory stays bounded however many shards there are. When a replica dies, its
shards go back to the queue and run on the replicas still alive (at-least-once underneath);
results are keyed by shard id, so a shard that somehow completes twice is reported once.

The scheduler never touches Ray: an :class:`Executor` submits calls and waits on them. The
coordinator actor plugs in a Ray executor (``ray.wait`` on actor calls); the tests and local
builds plug in :class:`LocalExecutor`, which runs plain replica objects in this process.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from .wire import relabel, where


@dataclasses.dataclass(frozen=True)
class Shard:
    """One unit of work: its id (also its place in the output) and the call's arguments."""

    index: int
    args: tuple = ()


class ReplicaDied(Exception):
    """The replica serving a call is gone (killed, crashed, its node lost)."""

    def __init__(self, replica: int, detail: str = ""):
        super().__init__(f"replica {replica} died{': ' + detail if detail else ''}")
        self.replica = replica


class NoReplicasLeft(RuntimeError):
    """Every replica died before the work was done."""


class Executor(Protocol):
    def submit(self, replica: int, method: str, *args) -> Any: ...

    def wait(self, futures: list, timeout: float | None) -> list:
        """The futures among ``futures`` that are done (at least one unless ``timeout`` passed)."""

    def result(self, future) -> Any:
        """The call's value; raises :class:`ReplicaDied` if its replica is gone, else the call's error."""


class Scheduler:
    def __init__(self, executor: Executor, replicas: Iterable[int], *, per_replica: int = 2,
                 names: dict[int, str] | None = None):
        if per_replica < 1:
            raise ValueError(f"per_replica must be >= 1, got {per_replica}")
        self.executor = executor
        self.live = list(dict.fromkeys(replicas))
        if not self.live:
            raise NoReplicasLeft("no replicas to run on: load the model with replicas >= 1")
        self.per_replica = per_replica
        self.names = names or {}
        self.resubmitted = 0
        self.dead: list[int] = []

    def run(self, method: str, shards: Iterable[Shard]) -> Iterator[tuple[Shard, Any]]:
        source = iter(shards)
        retry: collections.deque[Shard] = collections.deque()
        pending: dict[Any, tuple[Shard, int]] = {}
        load = collections.Counter()
        done: set[int] = set()
        exhausted = False
        while True:
            while self.live and (retry or not exhausted):
                replica = min(self.live, key=lambda r: load[r])
                if load[replica] >= self.per_replica:
                    break
                if retry:
                    shard = retry.popleft()
                else:
                    shard = next(source, None)
                    if shard is None:
                        exhausted = True
                        break
                pending[self.executor.submit(replica, method, *shard.args)] = (shard, replica)
                load[replica] += 1
            if not pending:
                if retry or not exhausted:
                    raise NoReplicasLeft(
                        f"all replicas died ({', '.join(map(str, self.dead))}) before the work was done; "
                        f"check the replicas' logs (ray logs / the dashboard) and the nodes' memory, then rerun"
                    )
                return
            for future in self.executor.wait(list(pending), None):
                shard, replica = pending.pop(future)
                load[replica] -= 1
                try:
                    result = self.executor.result(future)
                except ReplicaDied:
                    if replica in self.live:
                        self.live.remove(replica)
                        self.dead.append(replica)
                    retry.append(shard)
                    self.resubmitted += 1
                    continue
                except Exception as err:
                    raise relabel(err, where(replica, shard.index, self.names.get(replica, ""))) from err
                if shard.index in done:
                    continue
                done.add(shard.index)
                yield shard, result


class LocalExecutor:
    """Runs calls at once on plain replica objects in this process (tests, local builds).

    ``kill(i)`` makes replica ``i`` fail every later call as a dead replica would.
    """

    def __init__(self, replicas: list):
        self.replicas = replicas
        self.killed: set[int] = set()

    def kill(self, replica: int) -> None:
        self.killed.add(replica)

    def submit(self, replica: int, method: str, *args):
        if replica in self.killed:
            return _Done("dead", replica, None)
        try:
            return _Done("ok", replica, getattr(self.replicas[replica], method)(*args))
        except Exception as err:
            return _Done("err", replica, err)

    def wait(self, futures: list, timeout: float | None) -> list:
        return list(futures)

    def result(self, future):
        if future.status == "dead":
            raise ReplicaDied(future.replica)
        if future.status == "err":
            raise future.value
        return future.value


@dataclasses.dataclass(eq=False)
class _Done:
    status: str
    replica: int
    value: Any
