"""One build at a time per output: two builds racing for a folder (threads, processes), a build in
another process that holds it until it dies, a lease from another machine that expires, and a
build whose lease was broken, which stops. The lease itself: interp_engine/dataset/lease.py;
the same race on a bucket is in test_hostile_dataset.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from interp_engine import ActivationDataset, DatasetBusyError, DatasetExistsError, DatasetLeaseWarning
from interp_engine.dataset import lease as dataset_lease
from interp_engine.dataset.lease import Lease
from interp_engine.dataset.store import Store

from .small_builds import PROMPTS, race, small_build


def test_two_builds_in_threads_one_wins(llama, tmp_path):
    for round_ in range(4):
        out = tmp_path / f"r{round_}"
        barrier = threading.Barrier(2)
        outcome: dict[str, object] = {}

        def build(points):
            barrier.wait()
            try:
                outcome[points[0]] = small_build(llama, out, points=points)
            except DatasetExistsError as err:
                outcome[points[0]] = err

        threads = [threading.Thread(target=build, args=(p,)) for p in (["resid_post.1"], ["mlp_out.2"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [v for v in outcome.values() if not isinstance(v, Exception)]
        lost = [v for v in outcome.values() if isinstance(v, Exception)]
        assert len(won) == 1 and len(lost) == 1, outcome
        assert "being written by another build" in str(lost[0]) or "holds a different dataset" in str(lost[0])
        opened = ActivationDataset.open(out, verify=True)
        assert opened.manifest["identity"] == won[0].manifest["identity"]
        assert [p.name for p in out.iterdir() if p.name.startswith(("_lease", "."))] == []


def test_the_lease_is_exclusive_across_threads(tmp_path):
    assert race(Store.of(tmp_path / "d"), rounds=40) == 1


_CLAIMER = """
import json, sys, time
from interp_engine.dataset.lease import Lease, DatasetBusyError
from interp_engine.dataset.store import Store
store, held = Store.of(sys.argv[1]), []
print("ready", flush=True)
start, stop = map(float, sys.stdin.readline().split())
time.sleep(max(0.0, start - time.time()))
while time.time() < stop:
    try:
        lease = Lease.acquire(store)
    except DatasetBusyError:
        continue
    t0 = time.time(); time.sleep(0.01); held.append((t0, time.time())); lease.release()
print(json.dumps(held))
"""


def test_the_lease_is_exclusive_across_processes(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, str(tmp_path / "d")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 2  # both have imported the library
    start = time.time() + 0.2
    for p in procs:  # the same window for both: they contend for the whole of it
        p.stdin.write(f"{start} {start + 3}\n")
        p.stdin.flush()
    spans = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(spans), "each process should have held the folder at some point"
    for a0, a1 in spans[0]:
        for b0, b1 in spans[1]:
            assert a1 <= b0 or b1 <= a0, "two processes held the folder at once"


_HOLDER = """
import sys, time
from interp_engine.dataset.lease import Lease
from interp_engine.dataset.store import Store
lease = Lease.acquire(Store.of(sys.argv[1]))
print(lease.build_id, flush=True)
time.sleep(600)
"""


def test_a_build_in_another_process_blocks_until_it_dies(llama, tmp_path):
    out = tmp_path / "d"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        build_id = holder.stdout.readline().strip()
        with pytest.raises(DatasetBusyError, match=f"another build {build_id} \\(process {holder.pid} .*another output"):
            small_build(llama, out)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with pytest.warns(DatasetLeaseWarning, match=f"process {holder.pid} on this host, which has ended"):
        built = small_build(llama, out)
    assert built.rows == len(PROMPTS) and not list(out.glob("_lease-*"))


def _lease_file(folder: Path, host: str, age_s: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("_lease-" + "ab" * 16 + ".json")
    path.write_text(json.dumps({"build_id": "ab" * 16, "host": host, "pid": 4242, "held": True, "started": 0,
                                "renewed": time.time() - age_s, "ttl_s": dataset_lease.TTL_S}))
    return path


def test_a_lease_from_another_machine_expires(llama, tmp_path):
    out = tmp_path / "d"
    path = _lease_file(out, "node-7", age_s=1)
    with pytest.raises(DatasetBusyError, match="process 4242 on 'node-7'.*expires 60s after its last renewal"):
        small_build(llama, out)
    _lease_file(out, "node-7", age_s=dataset_lease.TTL_S + 5)
    with pytest.warns(DatasetLeaseWarning, match="last renewed 65s ago"):
        small_build(llama, out)
    assert not path.exists()


def test_a_build_whose_lease_was_broken_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_lease, "RENEW_S", 0.02)
    store = Store.of(tmp_path / "d")
    lease = Lease.acquire(store)
    lease.check()
    store.delete(lease.name)  # another build judged it stale
    lease._thread.join(timeout=30)  # the renewer ends once it finds its file gone
    assert not lease._thread.is_alive()
    with pytest.raises(DatasetBusyError, match="lost its lease.*rerun the same call"):
        lease.check()
    lease.release()
