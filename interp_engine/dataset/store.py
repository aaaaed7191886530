"""Where a dataset lives: a folder on any filesystem pyarrow knows, named once and used everywhere.

A :class:`Store` is a ``pyarrow.fs.FileSystem`` plus the dataset's root inside it. The driver
and every replica write through the same (picklable) store, so a dataset on object storage is
written straight to the bucket by the replicas, and a local one to the folder.

Publishing a file is atomic on every store:

- local disks and HDFS have an atomic rename: the bytes go to a hidden temporary name
  (``.NAME.tmp-<12 hex>``, see :mod:`.names`) and are renamed over the final name;
- object stores (S3, GCS, ...) have no rename, but an object becomes visible only once its
  upload completes: the file is serialised in memory first and sent as one upload under its
  final key, so a reader (or a resume) sees the whole file or nothing.

Each shard's size and sha256 are also recorded in the manifest (see :mod:`.integrity`),
which catches what the store cannot promise (a disk that flips bytes, a file truncated by hand).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pyarrow.fs as pafs

from .names import temp_name
from .uri import resolve_output

_RENAMES = ("local", "hdfs")  # filesystems with an atomic rename


@dataclasses.dataclass(frozen=True)
class Store:
    """A dataset's root folder on a pyarrow filesystem; ``label`` is how the user named it."""

    fs: pafs.FileSystem
    root: str
    label: str

    @classmethod
    def of(cls, output, filesystem: pafs.FileSystem | None = None) -> "Store":
        """A local path, a URI (``s3://bucket/prefix``, ``file://...``) or ``(filesystem, path)``."""
        return cls(*resolve_output(output, filesystem))

    @property
    def is_local(self) -> bool:
        return self.fs.type_name == "local"

    def key(self, name: str) -> str:
        return f"{self.root}/{name}" if self.root else name

    def location(self, name: str = "") -> str:
        """A file's (or the root's) full name for messages and readers: a local path or a URI."""
        if self.is_local:
            return str(Path(self.root) / name) if name else self.root
        base = self.label.rstrip("/")
        return f"{base}/{name}" if name else base

    def exists(self) -> bool:
        return self.fs.get_file_info(self.root).type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.fs.get_file_info(self.root).type == pafs.FileType.File

    def list(self) -> dict[str, int]:
        """Every file directly under the root, with its size in bytes."""
        selector = pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
        try:
            infos = self.fs.get_file_info(selector)
        except FileNotFoundError:
            # pyarrow found no folder, then saw one when it checked why: another build made it
            # in between (builds race to an empty output); now it is there to list
            infos = self.fs.get_file_info(selector)
        return {info.base_name: info.size for info in infos if info.type == pafs.FileType.File}

    def size(self, name: str) -> int | None:
        info = self.fs.get_file_info(self.key(name))
        return info.size if info.type == pafs.FileType.File else None

    def age_s(self, name: str) -> float | None:
        """Seconds since ``name`` was last written (``None`` if it is gone)."""
        import time

        info = self.fs.get_file_info(self.key(name))
        return None if info.type == pafs.FileType.NotFound or info.mtime is None else time.time() - info.mtime.timestamp()

    def read(self, name: str) -> bytes:
        with self.fs.open_input_stream(self.key(name)) as f:
            return f.read()

    def write(self, name: str, data: bytes, *, atomic: bool = True) -> None:
        """Publish ``data`` as ``name`` atomically (see the module docstring); ``atomic=False``
        writes it in place (a probe, whose own name already marks it temporary)."""
        if not atomic or self.fs.type_name not in _RENAMES:
            with self.fs.open_output_stream(self.key(name)) as f:
                f.write(data)
            return
        tmp = self.key(temp_name(name))
        try:
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            if self.is_local:
                os.replace(tmp, self.key(name))
            else:
                self.fs.move(tmp, self.key(name))
        finally:
            if self.fs.get_file_info(tmp).type != pafs.FileType.NotFound:
                self.fs.delete_file(tmp)

    def delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self.key(name))
        except FileNotFoundError:
            pass

    def make_root(self) -> None:
        """Create the root folder where folders are real (object stores need none)."""
        if self.fs.type_name in _RENAMES:
            self.fs.create_dir(self.root, recursive=True)
