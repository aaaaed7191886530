"""Naming a dataset's location: a local path, a URI, or ``(pyarrow.fs.FileSystem, path)``.

URIs go through ``pyarrow.fs.FileSystem.from_uri``, so credentials and endpoints come from the
standard environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...) unless an explicit ``filesystem=`` is given.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.fs as pafs

from .tokens import InputError

#: URI schemes pyarrow opens (``file`` and plain paths are local)
SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StorageError(InputError):
    """The dataset's location cannot be used (unknown scheme, no bucket, no credentials, read-only)."""


def resolve_output(output, filesystem: pafs.FileSystem | None = None):
    from .dataset_store import Store

    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], pafs.FileSystem):
        filesystem, output = output
    if isinstance(output, Path) or (isinstance(output, str) and not _URI.match(output)):
        if filesystem is not None and filesystem.type_name != "local":
            root = str(output).strip("/") if filesystem.type_name != "hdfs" else str(output)
            return Store(filesystem, root, f"{filesystem.type_name}:{output}")
        path = str(Path(output).expanduser().resolve())  # replicas may run in another folder
        return Store(filesystem or pafs.LocalFileSystem(), path, path)
    if not isinstance(output, str):
        raise InputError(f"output must be a path, a URI such as 's3://bucket/prefix', or (pyarrow filesystem, path); "
                         f"got {type(output).__name__}")
    scheme = _URI.match(output).group(1).lower()
    if scheme not in SCHEMES:
        raise StorageError(f"unknown storage scheme {scheme!r} in {output!r}; use a local path or one of "
                           f"{', '.join(s + '://' for s in SCHEMES)}")
    if filesystem is not None:
        root = output.split("://", 1)[1]
        return Store(filesystem, root.rstrip("/"), output)
    try:
        fs, root = pafs.FileSystem.from_uri(output)
    except (OSError, ValueError) as err:
        raise StorageError(f"cannot open {output!r}: {err}") from None
    if fs.type_name == "local":
        return Store(fs, str(Path(root).resolve()), str(Path(root).resolve()))
    return Store(fs, root.rstrip("/"), output)
