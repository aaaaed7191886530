"""The manifest of an activation dataset: what it was built from, so it can be trusted, resumed
and never mixed with another.

``_manifest.json`` sits beside the shards. Its ``identity`` holds everything that decides the
shards' content — model, weights hash, backend, model dtype, stored dtype, points, layout,
tokenizer hash, package version, prompt-set hash, shard size — and a rerun is the same build
only when the identity is equal. ``status`` and ``result`` record progress and totals, and ``shards`` each finished shard's
rows, bytes and sha256 (see :mod:`.dataset_integrity`). The manifest lives in the same store as
the shards and is rewritten whole (atomically) as shards land.
"""

from __future__ import annotations

import hashlib
import json
import weakref

from .dataset_shard import shard_name
from .fingerprint import weights_fingerprint as weights_fingerprint

FORMAT = "interp_engine.dataset/2"  # 2: nested fixed-size lists, bf16 as exact float32
MANIFEST = "_manifest.json"


class DatasetExistsError(FileExistsError):
    """The output path holds a different dataset (or other files)."""


#: tokenizer -> ((size, special tokens), digest): hashing a 49k-entry vocabulary takes 0.1-0.15 s,
#: which every build would otherwise spend before its first shard
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(hf_tokenizer) -> str:
    """sha256 of the tokenizer's class, vocabulary and special tokens. Kept per tokenizer object
    while its size and special tokens stay the same (adding tokens changes both)."""
    special = sorted((k, str(v)) for k, v in hf_tokenizer.special_tokens_map.items())
    key = (len(hf_tokenizer), json.dumps(special, ensure_ascii=False))
    cached = _FINGERPRINTS.get(hf_tokenizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    vocab = sorted(hf_tokenizer.get_vocab().items())
    payload = json.dumps([type(hf_tokenizer).__name__, vocab, special], ensure_ascii=False)
    digest = hashlib.sha256(payload.encode()).hexdigest()
    _FINGERPRINTS[hf_tokenizer] = (key, digest)
    return digest


def read_manifest(store) -> dict | None:
    """The manifest at ``store`` (a :class:`~.dataset_store.Store`), or ``None`` if there is none."""
    if store.size(MANIFEST) is None:
        return None
    return json.loads(store.read(MANIFEST))


def write_manifest(store, data: dict) -> None:
    store.write(MANIFEST, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def prepare_output(store, identity: dict, n_shards: int, *, overwrite: bool) -> tuple[dict, dict[int, str], dict[str, int]]:
    """Make the store ready for this build; return what a resume can keep.

    Same identity: a resume (the previous manifest's shard records and the shard files there are
    returned, to be checked). A different identity: refused unless ``overwrite`` (then the old
    dataset's files are removed). A folder with files but no manifest is never touched.
    Returns ``(shard records, {index: name} of shard files present, {name: size} of every file)``.
    """
    from .dataset_uri import check_writable

    if store.is_file():
        raise DatasetExistsError(f"output {store.location()!r} is a file; pass a folder path for the dataset")
    sizes = store.list()
    manifest = read_manifest(store)
    ours = [n for n in sizes if _is_ours(n)]
    foreign = [n for n in sizes if not _is_ours(n)]
    if manifest is None and any(".tmp-" not in n for n in sizes):
        raise DatasetExistsError(
            f"output {store.location()!r} already holds files ({', '.join(sorted(ours)[:3] + foreign[:3])}) "
            f"but no {MANIFEST}: it is not a dataset this engine wrote. Pick an empty or new folder."
        )
    if manifest is not None and manifest.get("identity") != identity:
        if not overwrite:
            raise DatasetExistsError(
                f"output {store.location()!r} holds a different dataset ({_diff(manifest.get('identity') or {}, identity)}). "
                f"Pick another output folder, or pass overwrite=True to replace it."
            )
    check_writable(store)  # after the refusals above, before anything is removed or written
    if manifest is not None and manifest.get("identity") != identity:
        for name in ours:
            store.delete(name)
        manifest, sizes = None, {}
    for name in [n for n in sizes if ".tmp-" in n]:  # left by a build that was killed mid-write
        store.delete(name)
    names = {shard_name(i, n_shards): i for i in range(n_shards)}
    present = {names[n]: n for n in sizes if n in names}
    return dict((manifest or {}).get("shards") or {}), present, sizes


def _is_ours(name: str) -> bool:
    return name == MANIFEST or (name.startswith("part-") and name.endswith(".parquet")) or ".tmp-" in name


def _diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    shown = [f"{k}: {_short(old.get(k))} there, {_short(new.get(k))} now" for k in keys[:4]]
    return "; ".join(shown) + ("; ..." if len(keys) > 4 else "")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
