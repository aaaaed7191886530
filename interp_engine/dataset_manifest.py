"""The manifest of an activation dataset: what it was built from, so it can be trusted, resumed
and never mixed with another.

``_manifest.json`` sits beside the shards. Its ``identity`` holds everything that decides the
shards' content — model, weights hash, backend, model dtype, stored dtype, points, layout,
tokenizer hash, package version, prompt-set hash, shard size — and a rerun is the same build
only when the identity is equal. ``status`` and ``result`` record progress and totals.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from .dataset_shard import shard_name
from .fingerprint import weights_fingerprint as weights_fingerprint

FORMAT = "interp_engine.dataset/1"
MANIFEST = "_manifest.json"


class DatasetExistsError(FileExistsError):
    """The output path holds a different dataset (or other files)."""


def tokenizer_fingerprint(hf_tokenizer) -> str:
    vocab = sorted(hf_tokenizer.get_vocab().items())
    special = sorted((k, str(v)) for k, v in hf_tokenizer.special_tokens_map.items())
    payload = json.dumps([type(hf_tokenizer).__name__, vocab, special], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def read_manifest(output) -> dict | None:
    path = Path(output) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def prepare_output(output, identity: dict, n_shards: int, *, overwrite: bool) -> set[int]:
    """Make ``output`` ready for this build and return the shards already finished there.

    Same identity: a resume (finished shards are kept). A different identity: refused unless
    ``overwrite`` (then the old dataset's files are removed). A folder with files but no
    manifest is never touched.
    """
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise DatasetExistsError(f"output {str(out)!r} is a file; pass a folder path for the dataset")
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    ours = [p for p in out.iterdir() if _is_ours(p)]
    foreign = [p.name for p in out.iterdir() if not _is_ours(p)]
    if manifest is None and (ours or foreign):
        raise DatasetExistsError(
            f"output {str(out)!r} already holds files ({', '.join(sorted(p.name for p in ours)[:3] + foreign[:3])}) "
            f"but no {MANIFEST}: it is not a dataset this engine wrote. Pick an empty or new folder."
        )
    if manifest is not None and manifest.get("identity") != identity:
        if not overwrite:
            raise DatasetExistsError(
                f"output {str(out)!r} holds a different dataset ({_diff(manifest.get('identity') or {}, identity)}). "
                f"Pick another output folder, or pass overwrite=True to replace it."
            )
        for path in ours:
            path.unlink()
        manifest = None
    for path in out.glob(".*.tmp-*"):  # left by a build that was killed mid-write
        path.unlink(missing_ok=True)
    names = {shard_name(i, n_shards): i for i in range(n_shards)}
    return {names[p.name] for p in out.glob("part-*.parquet") if p.name in names}


def _is_ours(path: Path) -> bool:
    return path.name == MANIFEST or (path.name.startswith("part-") and path.suffix == ".parquet") or ".tmp-" in path.name


def _diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    shown = [f"{k}: {_short(old.get(k))} there, {_short(new.get(k))} now" for k in keys[:4]]
    return "; ".join(shown) + ("; ..." if len(keys) > 4 else "")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
