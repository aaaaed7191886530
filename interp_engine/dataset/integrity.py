"""Shard integrity: every shard's size, row count and sha256 are recorded in the manifest as it
lands, and checked before a shard is trusted.

Two layers, so that corruption is caught with or without a record:

- the **manifest record** (``shards[name] = {rows, bytes, sha256}``): a resume and
  :meth:`ActivationDataset.verify` compare each file's size and sha256 with it, and then what
  the file's own Parquet footer says it is — the manifest identity, its shard index and its row
  count — with what the manifest says (a shard copied in from another dataset, or from another
  shard of this one, with its record edited to match, passes the sha256 but not this);
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

from .columns import IDENTITY_KEY, INDEX_KEY
from ..errors import DatasetCorruptError, DatasetRepairWarning


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a shard must hold: its row count and the identity embedded in its schema."""

    rows: int | None  # None: whatever the manifest records
    identity: str  # the manifest identity as JSON (sorted keys)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record(rows: int, data: bytes) -> dict:
    return {"rows": rows, "bytes": len(data), "sha256": sha256(data)}


def check_recorded(store, name: str, size: int | None, rec: dict, expected: Expected, index: int) -> str | None:
    """Why shard ``index`` does not match its record or the build (``None`` if it does): its size,
    its sha256, and the identity, shard index and row count embedded in its Parquet footer."""
    if size is None:
        return "missing"
    if size != rec["bytes"]:
        return f"{size} bytes, the manifest records {rec['bytes']}"
    if expected.rows is not None and rec["rows"] != expected.rows:
        return f"the manifest records {rec['rows']} rows, the build expects {expected.rows}"
    data = store.read(name)
    if sha256(data) != rec["sha256"]:
        return "sha256 differs from the manifest (its bytes changed)"
    return check_embedded(data, expected.identity, index, rec["rows"])


def check_embedded(data: bytes, identity: str, index: int, rows: int) -> str | None:
    """Why a shard's footer says it is not shard ``index`` of the dataset ``identity`` with ``rows``
    rows (a file copied in from another dataset or another shard, its record edited to match)."""
    try:
        meta = pq.read_metadata(pa.BufferReader(data))
        embedded = meta.schema.to_arrow_schema().metadata or {}
    except (OSError, pa.ArrowException) as err:
        return f"unreadable ({type(err).__name__}: {_first_line(err)})"
    try:
        theirs = json.loads(embedded.get(IDENTITY_KEY, b"null"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        theirs = None
    ours = json.loads(identity)
    if theirs != ours:
        return "it was written by a different build (its embedded identity differs from the manifest's)"
    if _format(ours) >= 3 and embedded.get(INDEX_KEY) != str(index).encode():
        found = embedded.get(INDEX_KEY, b"").decode(errors="replace") or "no index"
        return f"it is shard {found} of this dataset, not shard {index}"
    if meta.num_rows != rows:
        return f"{meta.num_rows} rows, the manifest records {rows}"
    return None


def check_unrecorded(store, name: str, expected: Expected, index: int) -> tuple[str | None, dict | None]:
    """Read a shard that has no record in full (page checksums verified): ``(reason, None)`` if
    it is bad, ``(None, record)`` if it is whole."""
    data = store.read(name)
    try:
        table = pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except (OSError, pa.ArrowException) as err:
        return f"unreadable ({type(err).__name__}: {_first_line(err)})", None
    reason = check_embedded(data, expected.identity, index, table.num_rows)
    if reason is not None:
        return reason, None
    if table.num_rows != expected.rows:
        return f"{table.num_rows} rows, the build expects {expected.rows}", None
    return None, record(table.num_rows, data)


def _format(identity: dict) -> int:
    version = str(identity.get("format", "")).rsplit("/", 1)[-1]
    return int(version) if version.isdigit() else 0


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else ""


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
            reason = check_recorded(store, name, sizes.get(name), rec, expected[index], index)
            if reason is None:
                good[index] = rec
        else:
            reason, rec = check_unrecorded(store, name, expected[index], index)
            if reason is None:
                good[index] = rec
        if reason is not None:
            warnings.warn(f"shard {store.location(name)} failed its check ({reason}); rewriting it",
                          DatasetRepairWarning, stacklevel=4)
            store.delete(name)
            bad.append(name)
    return good, bad


def verify_dataset(store, manifest: dict, *, full: bool) -> None:
    """Raise :class:`DatasetCorruptError` unless every shard the manifest lists is there with its
    recorded size (and, if ``full``, its sha256 and the manifest's identity, its own shard index
    and its recorded row count in its footer). ``manifest`` was checked by
    :func:`~.dataset_schema.parse_manifest`."""
    listed = manifest.get("shards") or {}
    files = manifest["result"]["files"]
    identity = identity_json(manifest["identity"])
    sizes = store.list()
    problems = []
    for index, name in enumerate(files):
        rec = listed.get(name)
        if rec is None:
            problems.append(f"{name}: no record in the manifest")
            continue
        if not full:
            size = sizes.get(name)
            reason = "missing" if size is None else (
                None if size == rec["bytes"] else f"{size} bytes, the manifest records {rec['bytes']}")
        else:
            reason = check_recorded(store, name, sizes.get(name), rec, Expected(None, identity), index)
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
