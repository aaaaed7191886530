"""Sharded work over replicas: bounded in flight, failover, exactly-once results.

A :class:`Scheduler` takes an iterable of :class:`Shard`\\ s and a set of replicas and yields
``(shard, result)`` once per shard id. It pulls shards from the iterable only when a replica
slot is free (and at most one per replica ahead), so memory stays bounded however many shards
there are. A busy replica gets a second shard queued only while more shards are left than
replicas: the last shards go to whichever replica comes free first. When a replica dies, its
shards go back to the queue and run on the replicas still alive (at-least-once underneath);
results are keyed by shard id, so a shard that somehow completes twice is reported once.

Self-healing: a replica that died is probed (``ping``); Ray restarts it (``max_restarts``) and the
probe answers once the new process has loaded the model, so the replica gets work again and the
run ends at full capacity. A probe that fails means the replica is gone for good. A shard that
fails ``max_attempts`` times (its replicas died under it, or it raised anything but an input
error, which fails at once) stops the run with :class:`ShardFailed`, naming the shard, the
replicas and the last error.

The scheduler never touches Ray: an :class:`Executor` submits calls and waits on them. The
coordinator actor plugs in a Ray executor (``ray.wait`` on actor calls); the tests and local
builds plug in :class:`LocalExecutor`, which runs plain replica objects in this process.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from interp_engine import cancel
from interp_engine.errors import ShardFailed

from interp_engine.wire import relabel, where


@dataclasses.dataclass(frozen=True)
class Shard:
    """One unit of work: its id (also its place in the output) and the call's arguments."""

    index: int
    args: tuple = ()


class ReplicaDied(Exception):
    """The replica serving a call is gone (killed, crashed, its node lost)."""

    def __init__(self, replica: int, detail: str = "", *, restarting: bool = False):
        super().__init__(f"replica {replica} died{': ' + detail if detail else ''}")
        self.replica = replica
        self.restarting = restarting  # Ray is restarting it: a later call may reach the new process


class NoReplicasLeft(RuntimeError):
    """Every replica died before the work was done."""


class Executor(Protocol):
    def submit(self, replica: int, method: str, *args) -> Any: ...

    def wait(self, futures: list, timeout: float | None) -> list:
        """The futures among ``futures`` that are done (at least one unless ``timeout`` passed)."""

    def result(self, future) -> Any:
        """The call's value; raises :class:`ReplicaDied` if its replica is gone, else the call's error."""


PROBE_EVERY_S = 0.5  # how often a restarting replica is asked whether it is back
RESTART_TIMEOUT_S = 600.0  # a replica still restarting after this long counts as gone

#: errors that come from the request itself (or its caller gave up): retrying cannot help, so
#: they fail at once
_DETERMINISTIC = (ValueError, TypeError, KeyError, cancel.Cancelled)


class Scheduler:
    def __init__(self, executor: Executor, replicas: Iterable[int], *, per_replica: int = 2,
                 names: dict[int, str] | None = None, max_attempts: int = 3):
        if per_replica < 1:
            raise ValueError(f"per_replica must be >= 1, got {per_replica}")
        self.executor = executor
        self.live = list(dict.fromkeys(replicas))
        if not self.live:
            raise NoReplicasLeft("no replicas to run on: load the model with replicas >= 1")
        self.per_replica = per_replica
        self.names = names or {}
        self.max_attempts = max_attempts
        self.resubmitted = 0
        self.rejoined = 0
        self.dead: list[int] = []  # gone for good (a probe found them dead)
        self.recovering: set[int] = set()  # died, probe still waiting for a restart
        self._down_since: dict[int, float] = {}

    def run(self, method: str, shards: Iterable[Shard]) -> Iterator[tuple[Shard, Any]]:
        source = iter(shards)
        retry: collections.deque[Shard] = collections.deque()
        ahead: collections.deque[Shard] = collections.deque()  # pulled from the source, not yet submitted
        pending: dict[Any, tuple[Shard, int]] = {}
        probes: dict[Any, int] = {}
        due: dict[int, float] = {}  # replica -> when to probe it again
        load = collections.Counter()
        failures: dict[int, list[int]] = collections.defaultdict(list)  # shard -> replicas it failed on
        done: set[int] = set()
        exhausted = False
        while True:
            cancel.checkpoint("while its shards were scheduled")  # submit nothing more for a cancelled call
            now = time.monotonic()
            for replica in [r for r, t in due.items() if t <= now]:
                del due[replica]
                probes[self.executor.submit(replica, "ping")] = replica
            while self.live and (retry or ahead or not exhausted):
                replica = min(self.live, key=lambda r: load[r])
                if load[replica] >= self.per_replica:
                    break
                while not exhausted and len(ahead) <= len(self.live):  # enough ahead to see the end coming
                    shard = next(source, None)
                    if shard is None:
                        exhausted = True
                    else:
                        ahead.append(shard)
                # Every replica is busy: queue a shard behind a running one only while more shards
                # are left than replicas. At the end of the work the last shards wait here for the
                # replica that comes free first, instead of sitting in a slower replica's queue
                # while another one idles (the tail that kept two replicas from halving the time).
                if load[replica] and len(retry) + len(ahead) <= len(self.live):
                    break
                if not (retry or ahead):
                    break
                shard = retry.popleft() if retry else ahead.popleft()
                pending[self.executor.submit(replica, method, *shard.args)] = (shard, replica)
                load[replica] += 1
            left = bool(retry or ahead or not exhausted)
            waiting = bool(probes or due) and left
            if not pending and not waiting:
                if left:
                    raise NoReplicasLeft(
                        f"all replicas died ({', '.join(map(str, self.dead))}) before the work was done; "
                        f"check the replicas' logs (ray logs / the dashboard) and the nodes' memory, then rerun"
                    )
                return
            timeout = max(0.0, min(due.values()) - time.monotonic()) if due else None
            futures = list(pending) + list(probes)
            if not futures:
                time.sleep(timeout or 0.0)
                continue
            for future in self.executor.wait(futures, timeout):
                if future in probes:
                    replica = probes.pop(future)
                    if self._probed(replica, future):  # still restarting: ask again a little later
                        due[replica] = time.monotonic() + PROBE_EVERY_S
                    continue
                shard, replica = pending.pop(future)
                load[replica] -= 1
                try:
                    result = self.executor.result(future)
                except ReplicaDied as err:
                    if replica in self.live:  # wait for Ray to restart it (max_restarts), then use it again
                        self.live.remove(replica)
                        self.recovering.add(replica)
                        self._down_since[replica] = time.monotonic()
                        probes[self.executor.submit(replica, "ping")] = replica
                    self._failed(shard, replica, failures, err)
                    retry.append(shard)
                    self.resubmitted += 1
                    continue
                except _DETERMINISTIC as err:
                    raise relabel(err, where(replica, shard.index, self.names.get(replica, ""))) from err
                except Exception as err:
                    self._failed(shard, replica, failures, err)
                    retry.append(shard)
                    self.resubmitted += 1
                    continue
                if shard.index in done:
                    continue
                done.add(shard.index)
                yield shard, result

    def _probed(self, replica: int, future) -> bool:
        """Handle a probe's answer; True if the replica is still restarting and needs another."""
        try:
            self.executor.result(future)
        except ReplicaDied as err:
            if err.restarting and time.monotonic() - self._down_since[replica] < RESTART_TIMEOUT_S:
                return True
            self.recovering.discard(replica)
            self.dead.append(replica)
            return False
        except Exception:
            self.recovering.discard(replica)
            self.dead.append(replica)
            return False
        self.recovering.discard(replica)
        self.live.append(replica)
        self.rejoined += 1
        return False

    def _failed(self, shard: Shard, replica: int, failures: dict, err: BaseException) -> None:
        failures[shard.index].append(replica)
        tried = failures[shard.index]
        if len(tried) >= self.max_attempts:
            raise ShardFailed(
                f"{where(replica, shard.index, self.names.get(replica, ''))} shard {shard.index} failed "
                f"{len(tried)} times (on replicas {', '.join(map(str, tried))}); last error: "
                f"{type(err).__name__}: {err}. The work stops here; fix the cause (a dataset build resumes "
                f"from the shards already written when rerun)"
            ) from err


class LocalExecutor:
    """Runs calls at once on plain replica objects in this process (tests, local builds).

    ``kill(i)`` makes replica ``i`` fail every later call as a dead replica would; ``crash(i)``
    fails its next call that way, after which it answers again (a replica Ray restarted).
    """

    def __init__(self, replicas: list):
        self.replicas = replicas
        self.killed: set[int] = set()
        self.crashed: set[int] = set()

    def kill(self, replica: int) -> None:
        self.killed.add(replica)

    def crash(self, replica: int) -> None:
        self.crashed.add(replica)

    def submit(self, replica: int, method: str, *args):
        if replica in self.killed or replica in self.crashed:
            self.crashed.discard(replica)
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
