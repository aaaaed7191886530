"""Shard integrity: corrupted, truncated and missing shards are caught on resume (and rewritten,
naming each), on open and by verify(); the repaired dataset equals a clean build byte for byte."""

from __future__ import annotations

import json
import warnings

import pytest

from interp_engine import ActivationDataset, DatasetCorruptError, DatasetRepairWarning, build_dataset
from interp_engine.dataset.manifest import MANIFEST

PROMPTS = [f"Prompt {i}: " + "lorem ipsum " * (1 + i % 5) for i in range(40)]
POINTS = ["resid_post.2", "z.1"]
NAME = "part-{:05d}-of-00010.parquet"


@pytest.fixture(scope="module")
def clean(llama, tmp_path_factory):
    ds = build_dataset(llama, PROMPTS, POINTS, tmp_path_factory.mktemp("clean") / "d", shard_size=4, progress=False)
    return {f.name: f.read_bytes() for f in ds.files}


def _build(llama, out, **kw):
    return build_dataset(llama, PROMPTS, POINTS, out, shard_size=4, progress=False, **kw)


def _flip(path, n=64):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + n] = bytes(b ^ 0xA5 for b in data[middle:middle + n])
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _files(ds):
    return {f.name: f.read_bytes() for f in ds.files}


def test_manifest_records_every_shard(llama, clean, tmp_path):
    ds = _build(llama, tmp_path / "d")
    import hashlib

    for f in ds.files:
        rec = ds.manifest["shards"][f.name]
        assert rec["bytes"] == f.stat().st_size and rec["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert sum(r["rows"] for r in ds.manifest["shards"].values()) == ds.rows == 40
    assert _files(ds) == clean


def test_resume_rewrites_flipped_truncated_and_missing_shards(llama, clean, tmp_path):
    out = tmp_path / "d"
    ds = _build(llama, out)
    _flip(out / NAME.format(7))  # same size, other bytes: only the checksum can tell
    _truncate(out / NAME.format(3))
    (out / NAME.format(5)).unlink()
    with pytest.warns(DatasetRepairWarning) as caught:
        again = _build(llama, out)
    messages = [str(w.message) for w in caught]
    assert any(NAME.format(7) in m and "sha256" in m for m in messages), messages
    assert any(NAME.format(3) in m and "bytes" in m for m in messages), messages
    assert len(messages) == 2  # a missing shard is simply written
    assert sorted(again.repaired) == [NAME.format(3), NAME.format(7)]
    assert again.resumed_shards == 7 and again.rows == ds.rows
    assert _files(again) == clean
    again.verify()


def test_shards_without_a_record_are_read_in_full(llama, clean, tmp_path):
    """The driver was killed after shards landed but before it saved their records: page
    checksums, row count and embedded identity decide."""
    out = tmp_path / "d"
    _build(llama, out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest.update(status="building", shards={})
    manifest.pop("result")
    (out / MANIFEST).write_text(json.dumps(manifest))
    _flip(out / NAME.format(2))
    _truncate(out / NAME.format(8))
    with pytest.warns(DatasetRepairWarning) as caught:
        again = _build(llama, out)
    messages = [str(w.message) for w in caught]
    assert any(NAME.format(2) in m and "unreadable" in m for m in messages), messages
    assert any(NAME.format(8) in m and "unreadable" in m for m in messages), messages
    assert sorted(again.repaired) == [NAME.format(2), NAME.format(8)] and again.resumed_shards == 8
    assert _files(again) == clean
    assert set(again.manifest["shards"]) == set(clean)


def test_a_clean_resume_warns_nothing(llama, tmp_path):
    out = tmp_path / "d"
    _build(llama, out)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DatasetRepairWarning)
        again = _build(llama, out)
    assert again.resumed_shards == 10 and again.repaired == ()


def test_open_and_verify_catch_corruption(llama, tmp_path):
    out = tmp_path / "d"
    built = _build(llama, out)
    opened = ActivationDataset.open(out, verify=True)
    assert opened.rows == built.rows and opened.to_arrow().equals(built.to_arrow())
    good = (out / NAME.format(4)).read_bytes()
    _truncate(out / NAME.format(4))
    with pytest.raises(DatasetCorruptError, match=NAME.format(4) + r".*Rerun the same build_dataset"):
        ActivationDataset.open(out)
    (out / NAME.format(4)).write_bytes(good)
    _flip(out / NAME.format(6))
    opened = ActivationDataset.open(out)  # same sizes: opening checks sizes only
    with pytest.raises(DatasetCorruptError, match=NAME.format(6) + ": sha256 differs"):
        opened.verify()
    with pytest.raises(DatasetCorruptError, match=NAME.format(6)):
        ActivationDataset.open(out, verify=True)
    with pytest.raises(FileNotFoundError, match="no dataset at"):
        ActivationDataset.open(tmp_path / "nothing")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "status": "building"}))
    with pytest.raises(DatasetCorruptError, match="has not finished"):
        ActivationDataset.open(out)
