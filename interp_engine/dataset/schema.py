"""What a manifest must hold before anything trusts it.

``_manifest.json`` is a file users can open and edit, so :func:`parse_manifest` checks every
field that opening, reading or resuming a dataset uses — its type, its range and its agreement
with the others — and raises :class:`~.dataset_integrity.DatasetCorruptError` naming the first
field that is wrong. The checks cost time in the manifest's length only: ``n_shards`` must equal
the number of files the result lists (and ``ceil(n_prompts / shard_size)``), so a manifest that
claims ten billion shards is refused at once, never enumerated.

Formats 1 to 3 are read (``FORMATS``); only the newest is written.
"""

from __future__ import annotations

import json
import re

from .columns import DTYPES
from ..errors import DatasetCorruptError
from .names import MANIFEST, shard_name
from .shard import LAYOUTS

#: formats this version reads: 1 (fixed_shape_tensor columns, no shard records), 2 (nested
#: lists, NUL-joined prompt hash), 3 (length-prefixed prompt hash, shard index in each file)
FORMATS = ("interp_engine.dataset/1", "interp_engine.dataset/2", "interp_engine.dataset/3")
STATUSES = ("building", "complete")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class _Bad(Exception):
    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")


def parse_manifest(raw: bytes, where: str) -> dict:
    """The manifest in ``raw``, checked; :class:`DatasetCorruptError` names the bad field."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise DatasetCorruptError(f"{where}: {MANIFEST} is not valid JSON ({_first_line(err)}); {_FIX}") from None
    try:
        check_manifest(data)
    except _Bad as err:
        raise DatasetCorruptError(f"{where}: {MANIFEST} field {err}; {_FIX}") from None
    return data


_FIX = ("restore it, or rebuild with the same build_dataset call and overwrite=True (which replaces only this "
        "dataset's own files)")


def check_manifest(data) -> None:
    _need(isinstance(data, dict), "(top level)", f"must be a JSON object, got {_kind(data)}")
    identity = _field(data, "identity", dict, "identity")
    _check_identity(identity)
    status = _field(data, "status", str, "status")
    _need(status in STATUSES, "status", f"must be one of {', '.join(STATUSES)}, got {status!r}")
    n_shards = identity["n_shards"]
    shards = data.get("shards", {})
    _need(isinstance(shards, dict), "shards", f"must be an object of shard records, got {_kind(shards)}")
    _need(len(shards) <= n_shards, "shards", f"holds {len(shards)} records for {n_shards} shards")
    for name, rec in shards.items():
        _check_record(name, rec, n_shards)
    if status == "complete":
        _check_result(_field(data, "result", dict, "result"), identity)


def _check_identity(identity: dict) -> None:
    fmt = _field(identity, "format", str, "identity.format")
    _need(fmt in FORMATS, "identity.format", f"{fmt!r} is not a format this version reads ({', '.join(FORMATS)})")
    points = _field(identity, "points", list, "identity.points")
    _need(bool(points) and all(isinstance(p, str) for p in points), "identity.points",
          "must be a non-empty list of point names")
    layout = _field(identity, "layout", str, "identity.layout")
    _need(layout in LAYOUTS, "identity.layout", f"must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    dtype = _field(identity, "dtype", str, "identity.dtype")
    _need(dtype in DTYPES, "identity.dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
    n_prompts = _int(identity, "n_prompts", "identity.n_prompts", 1)
    shard_size = _int(identity, "shard_size", "identity.shard_size", 1)
    n_shards = _int(identity, "n_shards", "identity.n_shards", 1)
    _need(n_shards == -(-n_prompts // shard_size), "identity.n_shards",
          f"is {n_shards}, but {n_prompts} prompts in shards of {shard_size} make {-(-n_prompts // shard_size)}")
    _int(identity, "max_length", "identity.max_length", 1)
    seed = identity.get("shuffle_seed")
    _need(seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0),
          "identity.shuffle_seed", f"must be null or an int >= 0, got {seed!r}")


def _check_record(name, rec, n_shards: int) -> None:
    where = f"shards[{name!r}]"
    _need(_shard_index(name, n_shards) is not None, where, f"is not a shard of this dataset (part-NNNNN-of-"
          f"{n_shards:05d}.parquet)")
    _need(isinstance(rec, dict), where, f"must be an object with rows, bytes and sha256, got {_kind(rec)}")
    _int(rec, "rows", f"{where}.rows", 0)
    _int(rec, "bytes", f"{where}.bytes", 0)
    sha = _field(rec, "sha256", str, f"{where}.sha256")
    _need(_SHA256.match(sha) is not None, f"{where}.sha256", "must be 64 lowercase hex digits")


def _check_result(result: dict, identity: dict) -> None:
    n_shards = identity["n_shards"]
    files = _field(result, "files", list, "result.files")
    _need(len(files) == n_shards, "result.files", f"lists {len(files)} files, identity.n_shards is {n_shards}")
    for i, name in enumerate(files):
        _need(name == shard_name(i, n_shards), f"result.files[{i}]", f"must be {shard_name(i, n_shards)!r}, "
              f"got {name!r}")
    _need(_int(result, "shards", "result.shards", 1) == n_shards, "result.shards",
          f"is {result['shards']}, identity.n_shards is {n_shards}")
    _need(_int(result, "prompts", "result.prompts", 1) == identity["n_prompts"], "result.prompts",
          f"is {result['prompts']}, identity.n_prompts is {identity['n_prompts']}")
    rows = _int(result, "rows", "result.rows", 0)
    _int(result, "tokens", "result.tokens", 0)
    if identity["layout"] == "sequence":
        _need(rows == identity["n_prompts"], "result.rows", f"is {rows}; a sequence dataset has a row per prompt "
              f"({identity['n_prompts']})")


def _shard_index(name, n_shards: int) -> int | None:
    if not isinstance(name, str) or not name.startswith("part-"):
        return None
    digits = name[5:].split("-of-", 1)[0]
    if not digits.isdigit() or int(digits) >= n_shards or name != shard_name(int(digits), n_shards):
        return None
    return int(digits)


def _field(data: dict, key: str, kind: type, where: str):
    _need(key in data, where, "is missing")
    value = data[key]
    _need(isinstance(value, kind), where, f"must be {_NAMES[kind]}, got {_kind(value)}")
    return value


def _int(data: dict, key: str, where: str, low: int) -> int:
    _need(key in data, where, "is missing")
    value = data[key]
    _need(isinstance(value, int) and not isinstance(value, bool), where, f"must be an integer, got {_kind(value)}")
    _need(value >= low, where, f"must be >= {low}, got {value}")
    return value


def _need(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise _Bad(field, problem)


_NAMES = {dict: "an object", list: "a list", str: "a string"}


def _kind(value) -> str:
    text = json.dumps(value) if isinstance(value, (int, float, str, type(None))) else type(value).__name__
    return {"dict": "an object", "list": "a list"}.get(text, text[:40])


def _first_line(err: Exception) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0][:200]
