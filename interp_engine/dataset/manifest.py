"""The manifest of an activation dataset: what it was built from, so it can be trusted, resumed
and never mixed with another.

``_manifest.json`` sits beside the shards. Its ``identity`` holds everything that decides the
shards' content — model, weights hash, backend, model dtype, stored dtype, points, layout,
tokenizer hash, package version, prompt-set hash, shard size — and a rerun is the same build
only when the identity is equal. ``status`` and ``result`` record progress and totals, and ``shards`` each finished shard's
rows, bytes and sha256 (see :mod:`.integrity`). The manifest lives in the same store as
the shards and is rewritten whole (atomically) as shards land; it is checked field by field
whenever it is read (:mod:`.schema`).

**The output folder.** A build deletes only files whose names have exactly the forms it writes
(:mod:`.names`): on ``overwrite=True`` the old dataset's shards, and on every run the
temporary files a killed build left. Any other file stays, and a
:class:`DatasetForeignFilesWarning` names it. A folder with files but no manifest is not a
dataset and is never written to.

**Format 3** hashes the prompts length-prefixed (:mod:`.prompts`); format 2 joined them
with NUL, so two different prompt lists could share a hash and one's build "resume" the other's.
A format 2 dataset still opens and reads, but a build never resumes it: its identity differs
(format and prompt hash), and the refusal says so and that ``overwrite=True`` rebuilds it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
import weakref

from ..errors import DatasetCorruptError, DatasetExistsError, DatasetForeignFilesWarning
from .names import LEASE, MANIFEST, SHARD, TTL_S, is_ours, is_temp, is_unleased_temp, shard_name
from ..fingerprint import weights_fingerprint as weights_fingerprint

#: 3: length-prefixed prompt hash, shard index in each file; 2: nested fixed-size lists, bf16 as exact float32
FORMAT = "interp_engine.dataset/3"


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
    """The manifest at ``store`` (a :class:`~.dataset_store.Store`), checked field by field, or
    ``None`` if there is none. A malformed one raises :class:`DatasetCorruptError` naming the field."""
    from .schema import parse_manifest

    if store.size(MANIFEST) is None:
        return None
    return parse_manifest(store.read(MANIFEST), store.location())


def write_manifest(store, data: dict) -> None:
    store.write(MANIFEST, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


@dataclasses.dataclass(frozen=True)
class Found:
    """What the output folder holds, as far as this build is concerned."""

    manifest: dict | None  # this build's own manifest (a resume), else None
    sizes: dict[str, int]  # every file there, by name
    replace: bool  # another dataset (or a corrupt manifest) is there, and overwrite=True replaces it


def inspect_output(store, identity: dict | None, *, overwrite: bool) -> Found:
    """Refuse an output this build must not write into; read-only.

    A file; a folder with files but no manifest; a different dataset (unless ``overwrite``); a
    dataset of an older format (unless ``overwrite``, which rebuilds it); a malformed manifest
    (unless ``overwrite``). Otherwise say what is there. ``identity=None`` (not known yet: a job
    checking before it loads the model) skips the comparisons that need it.
    """
    if store.is_file():
        raise DatasetExistsError(f"output {store.location()!r} is a file; pass a folder path for the dataset")
    sizes = store.list()
    try:
        manifest = read_manifest(store)
    except DatasetCorruptError:
        if not overwrite:
            raise
        return Found(None, sizes, replace=True)
    if manifest is None:
        kept = sorted(n for n in sizes if not (is_temp(n) or LEASE.match(n)))  # what a killed build leaves is ours
        if kept:
            raise DatasetExistsError(
                f"output {store.location()!r} already holds files ({_names(kept)}) but no {MANIFEST}: it is not a "
                f"dataset this engine wrote, and nothing there is touched. Pick an empty or new folder.")
        return Found(None, sizes, replace=False)
    old = manifest["identity"]
    if identity is None or old == identity:
        return Found(manifest, sizes, replace=False)
    if not overwrite:
        if old["format"] != identity["format"]:
            raise DatasetExistsError(
                f"output {store.location()!r} holds a dataset of format {old['format']!r}, written by an older "
                f"interp_engine; this one writes {identity['format']!r}, whose prompt hash tells apart prompt lists "
                f"the old one confused, so the old build cannot be resumed. ActivationDataset.open still reads it; "
                f"to rebuild it here pass overwrite=True, or pick another output folder.")
        raise DatasetExistsError(
            f"output {store.location()!r} holds a different dataset ({_diff(old, identity)}). "
            f"Pick another output folder, or pass overwrite=True to replace it.")
    return Found(None, sizes, replace=True)


def prepare_output(store, identity: dict, n_shards: int, *, overwrite: bool) -> tuple[dict, dict[int, str], dict[str, int]]:
    """Make the store ready for this build (which holds its lease); return what a resume can keep.

    Same identity: a resume (the previous manifest's shard records and the shard files there are
    returned, to be checked). A different identity with ``overwrite``: the old dataset's shards
    are removed (the new manifest replaces the old one). Temporary files of a killed build are
    removed. Files that are not ours stay, named in a :class:`DatasetForeignFilesWarning`.
    Returns ``(shard records, {index: name} of shard files present, {name: size} of every file)``.
    """
    found = inspect_output(store, identity, overwrite=overwrite)  # again: the folder may have changed
    sizes = dict(found.sizes)
    doomed = [n for n in sizes if (is_temp(n) and not _in_flight(store, n)) or (found.replace and SHARD.match(n))]
    for name in sorted(doomed):
        store.delete(name)
        del sizes[name]
    foreign = sorted(n for n in sizes if not is_ours(n))
    if foreign:
        warnings.warn(f"output {store.location()!r} holds {len(foreign)} file(s) that are not part of the dataset "
                      f"({_names(foreign)}); they were left as they are. Parquet readers given the whole folder "
                      f"would read them too: read the dataset with ActivationDataset.open(...) or move them.",
                      DatasetForeignFilesWarning, stacklevel=4)
    names = {shard_name(i, n_shards): i for i in range(n_shards)}
    present = {names[n]: n for n in sizes if n in names}
    return dict((found.manifest or {}).get("shards") or {}), present, sizes


def _in_flight(store, name: str) -> bool:
    """Whether a temporary file may still be being written by a live build. Shard and manifest
    files are written only by the holder of the folder's lease (this build); a probe or a lease
    is written by every build that starts, so one is left unless it is older than a lease lives."""
    if not is_unleased_temp(name):
        return False
    age = store.age_s(name)
    return age is not None and age < TTL_S


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", and {len(names) - 5} more" if len(names) > 5 else "")


def _diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    shown = [f"{k}: {_short(old.get(k))} there, {_short(new.get(k))} now" for k in keys[:4]]
    return "; ".join(shown) + ("; ..." if len(keys) > 4 else "")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
