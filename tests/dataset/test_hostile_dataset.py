"""Hostile input to datasets, as a catalogue: the output folder holds the user's files, two prompt
lists hash alike, two builds race for one bucket (for one folder: ``test_dataset_lease.py``), a
shard is swapped in with its record edited to match, a manifest is edited by hand. Each case is refused
with a project error that names what is wrong and the fix — or handled right — and nothing the
user owns is lost. The job entrypoint's cases are in ``tests/jobs/test_hostile_job.py``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from interp_engine import (ActivationDataset, DatasetBusyError, DatasetCorruptError, DatasetExistsError,
                           DatasetForeignFilesWarning, DatasetRepairWarning)
from interp_engine.dataset.lease import Lease
from interp_engine.dataset.manifest import MANIFEST
from interp_engine.dataset.store import Store

from .. import s3server
from .small_builds import PROMPTS, race, small_build

#: files a user keeps beside (or in) an output folder; none has the exact form of ours
USER_FILES = {"part-00000-3f2a9c.snappy.parquet": b"spark output", "report.tmp-final.txt": b"final report",
              "meeting.tmp-notes.md": b"# notes", ".part-00001-of-00003.parquet.tmp-notes": b"not a temp of ours",
              "_manifest.json.bak": b"{}", "part-1-of-3.parquet": b"short digits"}


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
    old = small_build(llama, out)
    _user(out)
    with pytest.warns(DatasetForeignFilesWarning, match=r"6 file\(s\) that are not part of the dataset.*left") as w:
        new = small_build(llama, out, points=["mlp_out.0"], overwrite=True)
    assert "part-00000-3f2a9c.snappy.parquet" in str(w[0].message)
    assert _kept(out)
    assert set(_files(out)) == set(USER_FILES) | {f.name for f in new.files} | {MANIFEST}
    assert {f.name for f in old.files} == {f.name for f in new.files}  # same names, new content
    ActivationDataset.open(out, verify=True)


def test_resume_removes_only_its_own_temporary_files(llama, tmp_path):
    out = tmp_path / "d"
    first = small_build(llama, out)
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
        again = small_build(llama, out)
    assert again.resumed_shards == 2 and _kept(out) and (out / young).exists()
    assert not any((out / name).exists() for name in ours)


def test_a_folder_of_user_files_is_refused_untouched(llama, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    _user(out)
    for overwrite in (False, True):
        with pytest.raises(DatasetExistsError, match="not a dataset this engine wrote, and nothing there is touched"):
            small_build(llama, out, overwrite=overwrite)
    assert _files(out) == USER_FILES


# --- prompt identity ----------------------------------------------------------------------------------


def test_prompt_lists_that_join_alike_are_different_datasets(llama, tmp_path):
    out = tmp_path / "d"
    first = small_build(llama, out, prompts=["alpha\0beta", "gamma"])
    with pytest.raises(DatasetExistsError, match="prompts_sha256: .* there, .* now.*overwrite=True"):
        small_build(llama, out, prompts=["alpha", "beta\0gamma"])
    second = small_build(llama, tmp_path / "e", prompts=["alpha", "beta\0gamma"])
    assert first.manifest["identity"]["prompts_sha256"] != second.manifest["identity"]["prompts_sha256"]


def test_a_dataset_of_the_old_format_is_read_but_never_resumed(llama, tmp_path):
    out = tmp_path / "d"
    built = small_build(llama, out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["identity"]["format"] = "interp_engine.dataset/2"
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert ActivationDataset.open(out).to_arrow().equals(built.to_arrow())
    with pytest.raises(DatasetExistsError, match="format 'interp_engine.dataset/2'.*cannot be resumed.*overwrite=True"):
        small_build(llama, out)
    assert small_build(llama, out, overwrite=True).manifest["identity"]["format"] == "interp_engine.dataset/3"


# --- object storage -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    with s3server.serving("acts") as server:
        yield server


def test_s3_keeps_user_objects_and_takes_one_build_at_a_time(s3, llama):
    fs = s3.filesystem()
    uri, root = "s3://acts/hostile/d", "acts/hostile/d"
    small_build(llama, uri)
    for name, data in USER_FILES.items():
        with fs.open_output_stream(f"{root}/{name}") as f:
            f.write(data)
    with pytest.warns(DatasetForeignFilesWarning, match="part-00000-3f2a9c.snappy.parquet"):
        small_build(llama, uri, points=["mlp_out.0"], overwrite=True)
    keys = {k.rsplit("/", 1)[1] for k in s3.keys("acts", "hostile/d")}
    assert set(USER_FILES) <= keys and all(fs.open_input_stream(f"{root}/{n}").read() == d
                                           for n, d in USER_FILES.items())
    store = Store.of(uri)
    lease = Lease.acquire(store)
    try:
        with pytest.raises(DatasetBusyError, match=f"another build {lease.build_id}"):
            small_build(llama, uri, points=["mlp_out.0"])
    finally:
        lease.release()
    assert race(store, rounds=8) == 1
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
    clean = small_build(llama, out)
    good = _shards(out)
    small_build(llama, other, points=["mlp_out.2"])
    _swap_in(out, 2, other / "part-00002-of-00003.parquet")
    ActivationDataset.open(out)  # sizes match the edited record
    with pytest.raises(DatasetCorruptError, match="part-00002-of-00003.parquet: it was written by a different build"):
        ActivationDataset.open(out, verify=True)
    with pytest.warns(DatasetRepairWarning, match="different build"):
        repaired = small_build(llama, out)
    assert _shards(out) == good and repaired.to_arrow().equals(clean.to_arrow())


def test_another_shard_of_the_same_dataset_fails_verify(llama, tmp_path):
    out = tmp_path / "d"
    small_build(llama, out)
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
    small_build(llama, out)
    return _files(out)


@pytest.mark.parametrize("edit,field", EDITS, ids=[f"edit{i}" for i in range(len(EDITS))])
def test_a_hand_edited_manifest_names_the_field(llama, pristine, tmp_path, edit, field):
    out = tmp_path / "d"
    out.mkdir()
    for name, data in pristine.items():
        (out / name).write_bytes(data)
    edited = edit(json.loads(pristine[MANIFEST]))
    (out / MANIFEST).write_text(edited if isinstance(edited, str) else json.dumps(edited))
    forwards = []
    handle = llama.hf.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        for call in (lambda: ActivationDataset.open(out, verify=True), lambda: small_build(llama, out)):
            with pytest.raises(DatasetCorruptError, match=f"{MANIFEST} (field )?{field}.*overwrite=True"):
                call()
    finally:
        handle.remove()
    assert not forwards, "the build ran the model before refusing the manifest"
    _user(out)
    with pytest.warns(DatasetForeignFilesWarning):
        rebuilt = small_build(llama, out, overwrite=True)
    assert _kept(out) and _shards(out) == {n: d for n, d in pristine.items() if n.startswith("part-0")}
    assert rebuilt.rows == len(PROMPTS)
