"""Hostile input to datasets, as a catalogue: the output folder holds the user's files, two prompt
lists hash alike, two builds race for one folder (threads, processes, a bucket), a shard is
swapped in with its record edited to match, a manifest is edited by hand. Each case is refused
with a project error that names what is wrong and the fix — or handled right — and nothing the
user owns is lost. The job entrypoint's cases are in ``tests/jobs/test_hostile_job.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from interp_engine import (ActivationDataset, DatasetBusyError, DatasetCorruptError, DatasetExistsError,
                           DatasetForeignFilesWarning, DatasetLeaseWarning, DatasetRepairWarning, build_dataset)
from interp_engine.dataset import lease as dataset_lease
from interp_engine.dataset.lease import Lease
from interp_engine.dataset.manifest import MANIFEST
from interp_engine.dataset.store import Store

from .. import s3server

PROMPTS = [f"Note {i}: " + "folder lease shard " * (1 + i % 3) for i in range(12)]
POINTS = ["resid_post.1"]
#: files a user keeps beside (or in) an output folder; none has the exact form of ours
USER_FILES = {"part-00000-3f2a9c.snappy.parquet": b"spark output", "report.tmp-final.txt": b"final report",
              "meeting.tmp-notes.md": b"# notes", ".part-00001-of-00003.parquet.tmp-notes": b"not a temp of ours",
              "_manifest.json.bak": b"{}", "part-1-of-3.parquet": b"short digits"}


@pytest.fixture(scope="module")
def llama(eager_models):
    return eager_models("llama")


def _build(llama, out, prompts=PROMPTS, points=POINTS, **kw):
    return build_dataset(llama, prompts, points, out, shard_size=4, progress=False, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob("part-0*-of-00003.parquet")}


def _user(folder: Path) -> None:
    for name, data in USER_FILES.items():
        (folder / name).write_bytes(data)


def _kept(folder: Path) -> bool:
    return all((folder / name).read_bytes() == data for name, data in USER_FILES.items())


# --- data loss: only files of our exact forms are ever deleted ---------------------------------------


def test_overwrite_deletes_only_the_old_datasets_files(llama, tmp_path):
    out = tmp_path / "d"
    old = _build(llama, out)
    _user(out)
    with pytest.warns(DatasetForeignFilesWarning, match=r"6 file\(s\) that are not part of the dataset.*left") as w:
        new = _build(llama, out, points=["mlp_out.0"], overwrite=True)
    assert "part-00000-3f2a9c.snappy.parquet" in str(w[0].message)
    assert _kept(out)
    assert set(_files(out)) == set(USER_FILES) | {f.name for f in new.files} | {MANIFEST}
    assert {f.name for f in old.files} == {f.name for f in new.files}  # same names, new content
    ActivationDataset.open(out, verify=True)


def test_resume_removes_only_its_own_temporary_files(llama, tmp_path):
    out = tmp_path / "d"
    first = _build(llama, out)
    _user(out)
    ours = [".part-00001-of-00003.parquet.tmp-0123456789ab", "._manifest.json.tmp-abcdef012345",
            ".write-check.tmp-00aa11bb22cc", "._lease-" + "7" * 32 + ".json.tmp-feedbeef0123"]
    for name in ours:
        (out / name).write_bytes(b"half a file")
        os.utime(out / name, (time.time() - 120, time.time() - 120))  # a killed build's, long ago
    young = ".write-check.tmp-0123456789ab"  # another build's probe, being written now: left alone
    (out / young).write_bytes(b"probe")
    first.files[1].unlink()
    with pytest.warns(DatasetForeignFilesWarning, match="meeting.tmp-notes.md"):
        again = _build(llama, out)
    assert again.resumed_shards == 2 and _kept(out) and (out / young).exists()
    assert not any((out / name).exists() for name in ours)


def test_a_folder_of_user_files_is_refused_untouched(llama, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    _user(out)
    for overwrite in (False, True):
        with pytest.raises(DatasetExistsError, match="not a dataset this engine wrote, and nothing there is touched"):
            _build(llama, out, overwrite=overwrite)
    assert _files(out) == USER_FILES


# --- prompt identity ----------------------------------------------------------------------------------


def test_prompt_lists_that_join_alike_are_different_datasets(llama, tmp_path):
    out = tmp_path / "d"
    first = _build(llama, out, prompts=["alpha\0beta", "gamma"])
    with pytest.raises(DatasetExistsError, match="prompts_sha256: .* there, .* now.*overwrite=True"):
        _build(llama, out, prompts=["alpha", "beta\0gamma"])
    second = _build(llama, tmp_path / "e", prompts=["alpha", "beta\0gamma"])
    assert first.manifest["identity"]["prompts_sha256"] != second.manifest["identity"]["prompts_sha256"]


def test_a_dataset_of_the_old_format_is_read_but_never_resumed(llama, tmp_path):
    out = tmp_path / "d"
    built = _build(llama, out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["identity"]["format"] = "interp_engine.dataset/2"
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert ActivationDataset.open(out).to_arrow().equals(built.to_arrow())
    with pytest.raises(DatasetExistsError, match="format 'interp_engine.dataset/2'.*cannot be resumed.*overwrite=True"):
        _build(llama, out)
    assert _build(llama, out, overwrite=True).manifest["identity"]["format"] == "interp_engine.dataset/3"


# --- one build at a time --------------------------------------------------------------------------------


def test_two_builds_in_threads_one_wins(llama, tmp_path):
    for round_ in range(4):
        out = tmp_path / f"r{round_}"
        barrier = threading.Barrier(2)
        outcome: dict[str, object] = {}

        def build(points):
            barrier.wait()
            try:
                outcome[points[0]] = _build(llama, out, points=points)
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


def _race(store, rounds: int, threads: int = 3) -> int:
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


def test_the_lease_is_exclusive_across_threads(tmp_path):
    assert _race(Store.of(tmp_path / "d"), rounds=40) == 1


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
            _build(llama, out)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with pytest.warns(DatasetLeaseWarning, match=f"process {holder.pid} on this host, which has ended"):
        built = _build(llama, out)
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
        _build(llama, out)
    _lease_file(out, "node-7", age_s=dataset_lease.TTL_S + 5)
    with pytest.warns(DatasetLeaseWarning, match="last renewed 65s ago"):
        _build(llama, out)
    assert not path.exists()


def test_a_build_whose_lease_was_broken_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_lease, "RENEW_S", 0.02)
    store = Store.of(tmp_path / "d")
    lease = Lease.acquire(store)
    lease.check()
    store.delete(lease.name)  # another build judged it stale
    time.sleep(0.3)
    with pytest.raises(DatasetBusyError, match="lost its lease.*rerun the same call"):
        lease.check()
    lease.release()


# --- object storage -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    with s3server.serving("acts") as server:
        yield server


def test_s3_keeps_user_objects_and_takes_one_build_at_a_time(s3, llama):
    fs = s3.filesystem()
    uri, root = "s3://acts/hostile/d", "acts/hostile/d"
    _build(llama, uri)
    for name, data in USER_FILES.items():
        with fs.open_output_stream(f"{root}/{name}") as f:
            f.write(data)
    with pytest.warns(DatasetForeignFilesWarning, match="part-00000-3f2a9c.snappy.parquet"):
        _build(llama, uri, points=["mlp_out.0"], overwrite=True)
    keys = {k.rsplit("/", 1)[1] for k in s3.keys("acts", "hostile/d")}
    assert set(USER_FILES) <= keys and all(fs.open_input_stream(f"{root}/{n}").read() == d
                                           for n, d in USER_FILES.items())
    store = Store.of(uri)
    lease = Lease.acquire(store)
    try:
        with pytest.raises(DatasetBusyError, match=f"another build {lease.build_id}"):
            _build(llama, uri, points=["mlp_out.0"])
    finally:
        lease.release()
    assert _race(store, rounds=8) == 1
    ActivationDataset.open(uri, verify=True)


# --- foreign shards -------------------------------------------------------------------------------------


def _swap_in(out: Path, index: int, source: Path) -> None:
    """Put ``source`` in place of shard ``index`` and edit its record to match, as an attacker would."""
    import hashlib

    import pyarrow.parquet as pq

    name = f"part-{index:05d}-of-00003.parquet"
    data = source.read_bytes()
    (out / name).write_bytes(data)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["shards"][name] = {"rows": pq.read_metadata(source).num_rows, "bytes": len(data),
                                "sha256": hashlib.sha256(data).hexdigest()}
    manifest["result"]["rows"] = sum(r["rows"] for r in manifest["shards"].values())
    (out / MANIFEST).write_text(json.dumps(manifest))


def test_a_shard_from_another_dataset_fails_verify(llama, tmp_path):
    out, other = tmp_path / "d", tmp_path / "other"
    clean = _build(llama, out)
    good = _shards(out)
    _build(llama, other, points=["mlp_out.2"])
    _swap_in(out, 2, other / "part-00002-of-00003.parquet")
    ActivationDataset.open(out)  # sizes match the edited record
    with pytest.raises(DatasetCorruptError, match="part-00002-of-00003.parquet: it was written by a different build"):
        ActivationDataset.open(out, verify=True)
    with pytest.warns(DatasetRepairWarning, match="different build"):
        repaired = _build(llama, out)
    assert _shards(out) == good and repaired.to_arrow().equals(clean.to_arrow())


def test_another_shard_of_the_same_dataset_fails_verify(llama, tmp_path):
    out = tmp_path / "d"
    _build(llama, out)
    (tmp_path / "copy").write_bytes((out / "part-00000-of-00003.parquet").read_bytes())
    _swap_in(out, 1, tmp_path / "copy")
    with pytest.raises(DatasetCorruptError, match="part-00001-of-00003.parquet: it is shard 0 of this dataset, not shard 1"):
        ActivationDataset.open(out, verify=True)


# --- hand-edited manifests ------------------------------------------------------------------------------

#: (edit of the manifest, the field the error must name)
EDITS = [
    (lambda m: "not json {", "is not valid JSON"),
    (lambda m: [m], r"\(top level\): must be a JSON object"),
    (lambda m: {k: v for k, v in m.items() if k != "identity"}, "identity: is missing"),
    (lambda m: {**m, "identity": ["a"]}, "identity: must be an object, got a list"),
    (lambda m: {**m, "identity": {k: v for k, v in m["identity"].items() if k != "points"}}, "identity.points: is missing"),
    (lambda m: {**m, "identity": {**m["identity"], "layout": "rows"}}, "identity.layout: must be one of"),
    (lambda m: {**m, "identity": {**m["identity"], "n_shards": 10 ** 10}}, "identity.n_shards: is 10000000000, but 12"),
    (lambda m: {**m, "identity": {**m["identity"], "n_prompts": 4 * 10 ** 10, "n_shards": 10 ** 10}},
     r"shards\['part-00000-of-00003.parquet'\]: is not a shard of this dataset \(part-NNNNN-of-10000000000"),
    (lambda m: {**m, "identity": {**m["identity"], "shard_size": "4"}}, "identity.shard_size: must be an integer"),
    (lambda m: {**m, "identity": {**m["identity"], "format": "interp_engine.dataset/9"}}, "identity.format: .* not a format"),
    (lambda m: {k: v for k, v in m.items() if k != "result"}, "result: is missing"),
    (lambda m: {**m, "result": {**m["result"], "files": m["result"]["files"][:2]}}, "result.files: lists 2 files"),
    (lambda m: {**m, "result": {**m["result"], "rows": True}}, "result.rows: must be an integer, got true"),
    (lambda m: {**m, "status": "done"}, "status: must be one of building, complete"),
    (lambda m: {**m, "shards": {k.replace("part-00001-of-00003.parquet", "../notes.txt"): v
                                for k, v in m["shards"].items()}},
     r"shards\['../notes.txt'\]: is not a shard of this dataset"),
    (lambda m: {**m, "shards": {k: {**v, "sha256": "xyz"} for k, v in m["shards"].items()}}, r"shards\[.*\]\.sha256: must be 64"),
    (lambda m: {**m, "shards": {k: None for k in m["shards"]}}, r"shards\['part-00000-of-00003.parquet'\]: must be an object"),
]


@pytest.fixture(scope="module")
def pristine(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("pristine") / "d"
    _build(llama, out)
    return _files(out)


@pytest.mark.parametrize("edit,field", EDITS, ids=[f"edit{i}" for i in range(len(EDITS))])
def test_a_hand_edited_manifest_names_the_field(llama, pristine, tmp_path, edit, field):
    out = tmp_path / "d"
    out.mkdir()
    for name, data in pristine.items():
        (out / name).write_bytes(data)
    edited = edit(json.loads(pristine[MANIFEST]))
    (out / MANIFEST).write_text(edited if isinstance(edited, str) else json.dumps(edited))
    started = time.perf_counter()
    for call in (lambda: ActivationDataset.open(out, verify=True), lambda: _build(llama, out)):
        with pytest.raises(DatasetCorruptError, match=f"{MANIFEST} (field )?{field}.*overwrite=True"):
            call()
    assert time.perf_counter() - started < 5
    _user(out)
    with pytest.warns(DatasetForeignFilesWarning):
        rebuilt = _build(llama, out, overwrite=True)
    assert _kept(out) and _shards(out) == {n: d for n, d in pristine.items() if n.startswith("part-0")}
    assert rebuilt.rows == len(PROMPTS)
