"""Shard integrity: every shard's size, row count and sha256 are recorded in the manifest as it
lands, and checked before a shard is trusted.

Two layers, so that corruption is caught with or without a record:

- the **manifest record** (``shards[name] = {rows, bytes, sha256}``): a resume and
  :meth:`ActivationDataset.verify` compare each file's size and sha256 with it;
- the **Parquet page checksums** (CRC32 of every data page, written with each shard): a shard
  that landed after the driver last saved the manifest (the driver was killed) has no record
  yet, so it is read in full with page verification, its row count and embedded identity
  checked, and then recorded.

A resume rewrites every shard that fails either check and warns naming it
(:class:`DatasetRepairWarning`); opening or verifying a finished dataset raises
:class:`DatasetCorruptError` naming the bad shards and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings

import pyarrow as pa
import pyarrow.parquet as pq


class DatasetCorruptError(RuntimeError):
    """Shards of a dataset are missing or do not match the manifest (the message names them)."""


class DatasetRepairWarning(UserWarning):
    """A resume found a shard that failed its check and is rewriting it."""


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a shard must hold: its row count and the identity embedded in its schema."""

    rows: int
    identity: str  # the manifest identity as JSON (sorted keys)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record(rows: int, data: bytes) -> dict:
    return {"rows": rows, "bytes": len(data), "sha256": sha256(data)}


def check_recorded(store, name: str, size: int | None, rec: dict, expected_rows: int | None = None) -> str | None:
    """Why the shard does not match its record (``None`` if it does)."""
    if size is None:
        return "missing"
    if size != rec["bytes"]:
        return f"{size} bytes, the manifest records {rec['bytes']}"
    if expected_rows is not None and rec["rows"] != expected_rows:
        return f"the manifest records {rec['rows']} rows, the build expects {expected_rows}"
    if sha256(store.read(name)) != rec["sha256"]:
        return "sha256 differs from the manifest (its bytes changed)"
    return None


def check_unrecorded(store, name: str, expected: Expected) -> tuple[str | None, dict | None]:
    """Read a shard that has no record in full (page checksums verified): ``(reason, None)`` if
    it is bad, ``(None, record)`` if it is whole."""
    data = store.read(name)
    try:
        table = pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except (OSError, pa.ArrowException) as err:
        return f"unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})", None
    embedded = (table.schema.metadata or {}).get(b"interp_engine.manifest", b"")
    if embedded.decode() != expected.identity:
        return "it was written by a different build (its embedded identity differs)", None
    if table.num_rows != expected.rows:
        return f"{table.num_rows} rows, the build expects {expected.rows}", None
    return None, record(table.num_rows, data)


def verify_existing(store, names: dict[int, str], sizes: dict[str, int], records: dict[str, dict],
                    expected: dict[int, Expected]) -> tuple[dict[int, dict], list[str]]:
    """Check the shards a resume found; delete the ones that fail (warning for each).

    Returns the records of the good shards by index, and the names of the deleted ones.
    """
    good: dict[int, dict] = {}
    bad: list[str] = []
    for index, name in sorted(names.items()):
        rec = records.get(name)
        if rec is not None:
            reason = check_recorded(store, name, sizes.get(name), rec, expected[index].rows)
            if reason is None:
                good[index] = rec
        else:
            reason, rec = check_unrecorded(store, name, expected[index])
            if reason is None:
                good[index] = rec
        if reason is not None:
            warnings.warn(f"shard {store.location(name)} failed its check ({reason}); rewriting it",
                          DatasetRepairWarning, stacklevel=3)
            store.delete(name)
            bad.append(name)
    return good, bad


def verify_dataset(store, manifest: dict, *, full: bool) -> None:
    """Raise :class:`DatasetCorruptError` unless every shard the manifest lists is there with its
    recorded size (and, if ``full``, its sha256)."""
    listed = manifest.get("shards") or {}
    files = manifest.get("result", {}).get("files") or sorted(listed)
    sizes = store.list()
    problems = []
    for name in files:
        rec = listed.get(name)
        if rec is None:
            problems.append(f"{name}: no record in the manifest")
            continue
        if not full:
            size = sizes.get(name)
            reason = "missing" if size is None else (
                None if size == rec["bytes"] else f"{size} bytes, the manifest records {rec['bytes']}")
        else:
            reason = check_recorded(store, name, sizes.get(name), rec)
        if reason:
            problems.append(f"{name}: {reason}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise DatasetCorruptError(
            f"dataset at {store.location()} has {len(problems)} bad shard(s): {shown}. Rerun the same build_dataset "
            f"call on this output: it keeps the good shards and rewrites these."
        )


def identity_json(identity: dict) -> str:
    return json.dumps(identity, sort_keys=True)
