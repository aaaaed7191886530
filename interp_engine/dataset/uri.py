"""Naming a dataset's location: a local path, a URI, or ``(pyarrow.fs.FileSystem, path)``.

URIs go through ``pyarrow.fs.FileSystem.from_uri``, so credentials and endpoints come from the
standard environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...) unless an explicit ``filesystem=`` is given.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.fs as pafs

from ..errors import InputError, StorageError

#: URI schemes pyarrow opens (``file`` and plain paths are local)
SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def resolve_output(output, filesystem: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str, str]:
    """``(filesystem, root, label)`` of a dataset's location (see :meth:`.dataset_store.Store.of`)."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], pafs.FileSystem):
        filesystem, output = output
    if isinstance(output, Path) or (isinstance(output, str) and not _URI.match(output)):
        if filesystem is not None and filesystem.type_name != "local":
            root = str(output).strip("/") if filesystem.type_name != "hdfs" else str(output)
            return (filesystem, root, f"{filesystem.type_name}:{output}")
        path = str(Path(output).expanduser().resolve())  # replicas may run in another folder
        return (filesystem or pafs.LocalFileSystem(), path, path)
    if not isinstance(output, str):
        raise InputError(f"output must be a path, a URI such as 's3://bucket/prefix', or (pyarrow filesystem, path); "
                         f"got {type(output).__name__}")
    scheme = _URI.match(output).group(1).lower()
    if scheme not in SCHEMES:
        raise StorageError(f"unknown storage scheme {scheme!r} in {output!r}; use a local path or one of "
                           f"{', '.join(s + '://' for s in SCHEMES)}")
    if filesystem is not None:
        root = output.split("://", 1)[1]
        return (filesystem, root.rstrip("/"), output)
    try:
        fs, root = pafs.FileSystem.from_uri(output)
    except (OSError, ValueError) as err:
        raise StorageError(f"cannot open {output!r}: {err}") from None
    if fs.type_name == "local":
        return (fs, str(Path(root).resolve()), str(Path(root).resolve()))
    return (fs, root.rstrip("/"), output)


def check_access(store, *, explicit: bool) -> None:
    """Fail fast, before any capture, if the store cannot hold this dataset: no credentials (S3,
    checked from the environment unless the filesystem was given explicitly), no bucket, or no
    permission to list it."""
    import pyarrow.fs as pafs

    if store.fs.type_name == "s3" and not explicit and not _aws_credentials():
        raise StorageError(
            f"no AWS credentials for {store.label!r}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
            f"AWS_ENDPOINT_URL for a non-AWS store) or AWS_PROFILE, or pass filesystem=pyarrow.fs.S3FileSystem(...) "
            f"(an instance role needs the explicit filesystem; anonymous=True for a public bucket)"
        )
    if store.is_local or store.fs.type_name == "hdfs":
        return
    bucket = store.root.split("/", 1)[0]
    try:
        found = store.fs.get_file_info(bucket).type != pafs.FileType.NotFound
    except OSError as err:
        raise StorageError(f"cannot reach bucket {bucket!r} of {store.label!r}: {_reason(err)}") from None
    if not found:
        raise StorageError(f"bucket {bucket!r} of {store.label!r} does not exist (or these credentials cannot see "
                           f"it); create it first (e.g. `aws s3 mb s3://{bucket}`) or fix the name")


def check_writable(store) -> None:
    """Write and delete a small probe file: a read-only destination fails here, not after the
    first shard was captured. The probe's name marks it temporary, so a resume removes one left
    by a killed process."""
    from .names import temp_name

    name = temp_name("write-check")
    try:
        store.make_root()
        store.write(name, b"interp_engine write check\n", atomic=False)
        store.delete(name)
    except OSError as err:
        raise StorageError(f"cannot write to {store.location()!r} ({_reason(err)}): the destination is read-only "
                           f"for these credentials. Grant write and delete there (S3: s3:PutObject, "
                           f"s3:DeleteObject), or pick another output") from None


def _reason(err: OSError) -> str:
    text = str(err)
    for code, meaning in (("ACCESS_DENIED", "access denied"), ("INVALID_ACCESS_KEY_ID", "the access key is not known"),
                          ("SIGNATURE_DOES_NOT_MATCH", "the secret key does not match"),
                          ("NO_SUCH_BUCKET", "no such bucket"), ("NETWORK_CONNECTION", "cannot connect")):
        if code in text:
            return meaning
    if isinstance(err, PermissionError):
        return "permission denied"
    return text.splitlines()[0][:200]


def _aws_credentials() -> bool:
    import os

    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True
    if any(env.get(k) for k in ("AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                                "AWS_CONTAINER_CREDENTIALS_FULL_URI")):
        return True
    files = [env.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), env.get("AWS_CONFIG_FILE", "~/.aws/config")]
    return any(Path(f).expanduser().is_file() for f in files)
