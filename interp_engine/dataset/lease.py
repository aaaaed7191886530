"""One build at a time per output folder: a lease, on any store.

Two builds writing into one folder (two threads, two processes, two machines on one bucket)
would mix their shards and manifests. So a build first claims the folder, and keeps the claim
until it returns:

1. it writes its own lease file ``_lease-<build id>.json`` (who: build id, host, pid; when:
   started, last renewed), published whole like every file (:mod:`.store`);
2. it lists the folder: if no *other live* lease is there, it holds the folder. If another build
   already holds it, this one removes its file and is refused with :class:`DatasetBusyError`
   naming that build. If the other is only contending too, both step back and retry after a
   random pause (a few times, then refuse).

Two builds can never both hold the folder: each decides only after its own file is visible, so
whichever lists second sees the other's file. This needs only what every store gives — a write
visible to a listing that starts after it ends (local disks; S3, GCS and Azure since their
strong consistency) — not an exclusive create (``O_EXCL``), which object stores lack. The same
rule serves local folders, so one mechanism is tested everywhere; and it lets a stale lease be
broken without the race a single lock file has (two breakers each deleting the other's new lock).

**Stale leases.** A holder rewrites its file every ``RENEW_S`` seconds from a background
thread. A lease counts as dead, is ignored and removed (with a :class:`DatasetLeaseWarning`
naming it), when it was not renewed for ``TTL_S`` seconds (a crashed build on any machine: this
assumes the machines' clocks agree to well within ``TTL_S``), or at once when it names this host
and a process that no longer exists (a killed build on this machine). An unreadable lease file is
dead. A build whose own lease was removed (it stalled past ``TTL_S``, and another build took
the folder) finds out at its next renewal and stops at its next manifest save with
:class:`DatasetBusyError`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import uuid
import warnings

from .manifest import inspect_output
from ..errors import DatasetBusyError, DatasetExistsError, DatasetLeaseWarning
from .names import LEASE, TTL_S, lease_name

RENEW_S = 10.0  # how often a holder renews its lease
_ATTEMPTS = 6  # contending without a holder: retries before refusing


class Lease:
    """This build's claim on a dataset folder. :meth:`acquire` one; :meth:`release` it when done."""

    def __init__(self, store):
        self.store = store
        self.build_id = uuid.uuid4().hex
        self.name = lease_name(self.build_id)
        self.started = time.time()
        self.lost: str | None = None  # why this build no longer holds the folder
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, store) -> "Lease":
        """Claim ``store``'s folder, or raise :class:`DatasetBusyError` (see the module docstring)."""
        lease = cls(store)
        store.make_root()
        others: list[dict] = []
        for attempt in range(_ATTEMPTS):
            lease._write(held=False)
            others = lease._live_others()
            if not others:
                lease._write(held=True)
                lease._thread = threading.Thread(target=lease._renew, name=f"lease-{lease.build_id[:8]}", daemon=True)
                lease._thread.start()
                return lease
            store.delete(lease.name)
            holder = next((o for o in others if o.get("held")), None)
            if holder is not None:
                raise DatasetBusyError(busy_message(store, holder))
            time.sleep(random.uniform(0.02, 0.1) * (attempt + 1))
        raise DatasetBusyError(
            f"output {store.location()!r}: other builds kept starting there at the same time as this one "
            f"({', '.join(_who(o) for o in others)}); one build at a time writes a dataset folder. Retry once they "
            f"have finished, or pick another output folder.")

    def check(self) -> None:
        """Raise :class:`DatasetBusyError` if this build lost the folder (its lease was broken)."""
        if self.lost is not None:
            raise DatasetBusyError(
                f"this build ({self.build_id}) lost its lease on {self.store.location()!r}: {self.lost}. Another "
                f"build may be writing there; rerun the same call when it has finished (it resumes).")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None:
            self.store.delete(self.name)

    def _record(self, held: bool) -> dict:
        return {"build_id": self.build_id, "host": socket.gethostname(), "pid": os.getpid(), "held": held,
                "started": self.started, "renewed": time.time(), "ttl_s": TTL_S}

    def _write(self, held: bool) -> None:
        self.store.write(self.name, (json.dumps(self._record(held)) + "\n").encode())

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                mine = _read(self.store, self.name)
                if mine is None or mine.get("build_id") != self.build_id:
                    self.lost = "its lease file was removed (as stale, by another build)"
                    return
                self._write(held=True)
            except OSError as err:  # a store that is down now may be up at the next renewal
                warnings.warn(f"could not renew the lease on {self.store.location()!r}: {err}", DatasetLeaseWarning,
                              stacklevel=1)

    def _live_others(self) -> list[dict]:
        """The other builds' live leases; dead ones are removed on the way."""
        live = []
        for name in sorted(self.store.list()):
            if name == self.name or not LEASE.match(name):
                continue
            record = _read(self.store, name)
            if record is None:  # released since the listing
                continue
            why = dead(record)
            if why is None:
                live.append(record)
                continue
            warnings.warn(f"removing {self.store.location(name)}: {why}", DatasetLeaseWarning, stacklevel=4)
            self.store.delete(name)
        return live


def holder(store) -> dict | None:
    """The live lease of a build holding ``store``'s folder now, if any (read-only)."""
    for name in sorted(store.list()):
        if LEASE.match(name):
            record = _read(store, name)
            if record and record.get("held") and dead(record) is None:
                return record
    return None


def _read(store, name: str):
    """A lease file's record; ``{}`` if it cannot be read as one, ``None`` if it is gone."""
    for attempt in range(3):
        try:
            data = store.read(name)
            break
        except FileNotFoundError:
            return None
        except OSError:  # an object store's read of an object deleted meanwhile can fail mid-stream
            if store.size(name) is None:
                return None
            if attempt == 2:
                raise
            time.sleep(0.05)
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def dead(record: dict, now: float | None = None) -> str | None:
    """Why a lease record is dead (``None``: it is live)."""
    now = time.time() if now is None else now
    renewed, ttl = record.get("renewed"), record.get("ttl_s", TTL_S)
    if not isinstance(renewed, (int, float)) or not isinstance(ttl, (int, float)) or not record.get("build_id"):
        return "it is not a lease record this engine wrote"
    if now - renewed > ttl:
        return f"the lease of build {record['build_id']} was last renewed {now - renewed:.0f}s ago (it expires after {ttl:g}s)"
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0 and not _alive(pid):
        return f"build {record['build_id']} ran as process {pid} on this host, which has ended"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _who(record: dict) -> str:
    return f"build {record.get('build_id')} (process {record.get('pid')} on {record.get('host')!r})"


def busy_message(store, holder: dict) -> str:
    age = time.time() - holder.get("renewed", time.time())
    return (f"output {store.location()!r} is being written by another {_who(holder)}, which renewed its lease "
            f"{age:.0f}s ago; one build at a time writes a dataset folder. Wait for it to finish (then rerun: a "
            f"finished identical build is reused), or pick another output folder. If that build is dead, its lease "
            f"expires {TTL_S:g}s after its last renewal (at once if its process on this host has ended), or delete "
            f"{store.location(lease_name(holder.get('build_id', '')))} by hand.")


def inspect_free_output(store, identity: dict | None, *, overwrite: bool):
    """:func:`inspect_output`'s refusals, with a folder that another live build is writing now
    refused as busy: its shards (written before its manifest) are not read as foreign files."""
    record = holder(store)
    if record is None:
        try:
            return inspect_output(store, identity, overwrite=overwrite)
        except DatasetExistsError:
            record = holder(store)  # it may have started between the two looks
            if record is None:
                raise
    raise DatasetBusyError(busy_message(store, record))
