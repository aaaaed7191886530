"""The file names a dataset build creates in its output folder, and nothing else.

A build may delete a file only if it is certain the file is its own, so every name it writes
has one exact form:

- ``_manifest.json``: the manifest (:mod:`.manifest`);
- ``part-NNNNN-of-NNNNN.parquet``: shard ``i`` of ``n`` (five digits or more each);
- ``_lease-<32 hex>.json``: a build's claim on the folder (:mod:`.lease`);
- ``.<one of the above>.tmp-<12 hex>`` and ``.write-check.tmp-<12 hex>``: a file being
  published (written, then renamed over its final name) and the write probe.

Anything else in the folder is the user's: a build leaves it alone and says so. A Spark-style
``part-00000-3f2a9c.snappy.parquet`` or a ``notes.tmp-final.txt`` is not one of ours.
"""

from __future__ import annotations

import re
import uuid

MANIFEST = "_manifest.json"
_SHARD = r"part-\d{5,}-of-\d{5,}\.parquet"
_LEASE = r"_lease-[0-9a-f]{32}\.json"
SHARD = re.compile(rf"^{_SHARD}$")
LEASE = re.compile(rf"^{_LEASE}$")
TEMP = re.compile(rf"^\.(?:{_SHARD}|_manifest\.json|{_LEASE}|write-check)\.tmp-[0-9a-f]{{12}}$")
#: temporary files written by builds that do not hold the folder (yet): contenders' leases, probes
UNLEASED_TEMP = re.compile(rf"^\.(?:{_LEASE}|write-check)\.tmp-[0-9a-f]{{12}}$")
#: seconds after its last renewal at which a lease (and a lease or probe temp file) counts as dead
TTL_S = 60.0


def shard_name(index: int, n_shards: int) -> str:
    return f"part-{index:05d}-of-{n_shards:05d}.parquet"


def lease_name(build_id: str) -> str:
    return f"_lease-{build_id}.json"


def temp_name(name: str) -> str:
    """A fresh temporary name for publishing ``name`` (``name`` is one of ours, or ``write-check``)."""
    return f".{name}.tmp-{uuid.uuid4().hex[:12]}"


def is_temp(name: str) -> bool:
    return TEMP.match(name) is not None


def is_unleased_temp(name: str) -> bool:
    return UNLEASED_TEMP.match(name) is not None


def is_ours(name: str) -> bool:
    """Whether ``name`` has exactly the form of a file a build writes."""
    return name == MANIFEST or SHARD.match(name) is not None or LEASE.match(name) is not None or is_temp(name)
