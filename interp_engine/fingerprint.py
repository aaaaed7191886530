"""A fingerprint of a model's weights: what a dataset manifest records so that a resume, or a
reader, can tell which weights produced the activations."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weights_fingerprint(folder) -> str:
    """sha256 over the model folder's weight files and config (names and bytes, sorted); cached
    per process while the files' sizes and times are unchanged."""
    folder = Path(folder).resolve()
    files = tuple(sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"))
    return _fingerprint(files, tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=16)
def _fingerprint(files: tuple[Path, ...], signature: tuple) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()
