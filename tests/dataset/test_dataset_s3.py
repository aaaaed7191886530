"""Datasets on object storage, against a real S3-protocol server on 127.0.0.1 (moto_server with
IAM auth, see tests/s3server.py): a build into ``s3://`` equals the local-path build bit for bit,
opens and verifies from the bucket, resumes and repairs there; bad destinations fail before any
capture with nothing written."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pyarrow.fs as pafs
import pytest

from interp_engine import (ActivationDataset, DatasetCorruptError, DatasetExistsError, DatasetRepairWarning,
                           StorageError, build_dataset)

from .. import s3server

PROMPTS = [f"Doc {i}: " + "storage bucket key " * (1 + i % 4) for i in range(18)]
POINTS = ["resid_post.1", "z.0"]


@pytest.fixture(scope="module")
def s3():
    with s3server.serving("acts") as server:
        yield server


@pytest.fixture(scope="module")
def local(llama, tmp_path_factory):
    return build_dataset(llama, PROMPTS, POINTS, tmp_path_factory.mktemp("s3local") / "d", layout="token",
                         shard_size=4, progress=False)


def _objects(s3, prefix):
    fs = s3.filesystem()
    return {path.rsplit("/", 1)[1]: fs.open_input_stream(path).read() for path in s3.keys("acts", prefix)}


def test_s3_build_equals_the_local_build(s3, llama, local):
    ds = build_dataset(llama, PROMPTS, POINTS, "s3://acts/one/ds", layout="token", shard_size=4, progress=False)
    objects = _objects(s3, "one/ds")
    assert sorted(objects) == sorted([f.name for f in local.files] + ["_manifest.json"])  # no temporary keys
    assert all(objects[f.name] == f.read_bytes() for f in local.files)
    assert ds.files == [f"s3://acts/one/ds/{f.name}" for f in local.files]
    opened = ActivationDataset.open("s3://acts/one/ds", verify=True)
    assert opened.to_arrow().equals(local.to_arrow()) and opened.rows == local.rows
    fs_given = ActivationDataset.open((s3.filesystem(), "acts/one/ds"))
    assert fs_given.tensor("z.0").equal(local.tensor("z.0"))


def test_s3_resume_repairs_and_refuses_like_a_folder(s3, llama, local):
    uri = "s3://acts/two/ds"
    build_dataset(llama, PROMPTS, POINTS, uri, layout="token", shard_size=4, progress=False)
    fs = s3.filesystem()
    bad = "acts/two/ds/" + local.files[1].name
    data = bytearray(fs.open_input_stream(bad).read())
    data[len(data) // 2] ^= 0xFF
    with fs.open_output_stream(bad) as f:
        f.write(bytes(data))
    fs.delete_file("acts/two/ds/" + local.files[3].name)
    short = "acts/two/ds/" + local.files[4].name
    head = fs.open_input_stream(short).read()[:500]
    with fs.open_output_stream(short) as f:  # truncated
        f.write(head)
    with pytest.raises(DatasetCorruptError, match=local.files[1].name):
        ActivationDataset.open(uri, verify=True)
    with pytest.warns(DatasetRepairWarning) as caught:
        again = build_dataset(llama, PROMPTS, POINTS, uri, layout="token", shard_size=4, progress=False)
    messages = " ".join(str(w.message) for w in caught)
    assert local.files[1].name in messages and local.files[4].name in messages
    assert again.repaired == (local.files[1].name, local.files[4].name)
    assert again.resumed_shards == len(local.files) - 3
    objects = _objects(s3, "two/ds")
    assert all(objects[f.name] == f.read_bytes() for f in local.files)
    with pytest.raises(DatasetExistsError, match="holds a different dataset.*overwrite=True"):
        build_dataset(llama, PROMPTS[:5], POINTS, uri, layout="token", shard_size=4, progress=False)
    replaced = build_dataset(llama, PROMPTS[:5], POINTS, uri, layout="token", shard_size=4, progress=False,
                             overwrite=True)
    assert replaced.rows == sum(len(llama.tok.encode(p)) for p in PROMPTS[:5])
    assert sorted(_objects(s3, "two/ds")) == sorted([f.rsplit("/", 1)[1] for f in replaced.files] + ["_manifest.json"])


@pytest.fixture
def no_capture(monkeypatch):
    """Any capture fails the test: the errors below must come before one starts."""
    import interp_engine.dataset.shard as shard

    def refuse(*args, **kwargs):
        raise AssertionError("a capture started")

    monkeypatch.setattr(shard, "run_padded", refuse)


def test_bad_destinations_fail_before_any_capture(s3, llama, no_capture, monkeypatch, tmp_path):
    before = s3.keys("acts")

    def build(output, **kw):
        return build_dataset(llama, PROMPTS, POINTS, output, progress=False, **kw)

    with pytest.raises(StorageError, match="unknown storage scheme 'ftp'.*s3://"):
        build("ftp://host/acts")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' .* does not exist"):
        build("s3://no-such-bucket/ds")
    wrong = s3.filesystem("AKIAWRONGWRONGWRONG", "wrong")
    with pytest.raises(StorageError, match="cannot reach bucket 'acts'.*(access key is not known|access denied)"):
        build("s3://acts/wrong", filesystem=wrong)
    key, secret = s3.user("reader", ["s3:Get*", "s3:List*", "s3:Head*"])
    with pytest.raises(StorageError, match="read-only for these credentials.*s3:PutObject"):
        build("s3://acts/readonly", filesystem=s3.filesystem(key, secret))
    with monkeypatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            env.delenv(name, raising=False)
        env.setenv("HOME", str(tmp_path))
        env.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
        env.delenv("AWS_CONFIG_FILE", raising=False)
        with pytest.raises(StorageError, match="no AWS credentials .*AWS_ACCESS_KEY_ID"):
            build("s3://acts/nocreds")
    assert s3.keys("acts") == before  # nothing written anywhere


@contextlib.contextmanager
def read_only_dir(path):
    """A directory this process cannot write into: mode 0o555 and, for root (who writes through
    any mode bits), the immutable attribute as well; a skip that says why where neither holds."""
    path.mkdir()
    path.chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"running as root, where only an immutable directory is read-only, and `chattr +i` "
                        f"failed here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o755)


def test_a_read_only_folder_fails_before_any_capture(llama, no_capture, tmp_path):
    with read_only_dir(tmp_path / "locked") as locked:
        with pytest.raises(OSError):  # the premise: nothing can be written there, even by root
            (locked / "probe").write_bytes(b"")
        with pytest.raises(StorageError, match="read-only"):
            build_dataset(llama, PROMPTS, POINTS, locked / "ds", progress=False)
        assert list(locked.iterdir()) == []


def test_uri_forms_name_the_same_place(tmp_path):
    from interp_engine.dataset.store import Store

    plain = Store.of(tmp_path / "d")
    assert Store.of(f"file://{tmp_path}/d").root == plain.root == str(tmp_path / "d")
    assert Store.of((pafs.LocalFileSystem(), str(tmp_path / "d"))).root == plain.root
    remote = Store.of("s3://bucket/a/b/")
    assert (remote.fs.type_name, remote.root, remote.location("x")) == ("s3", "bucket/a/b", "s3://bucket/a/b/x")
