"""Activation datasets: capture points over a prompt set and write them as Parquet shards.

``build_dataset(model, prompts, points, output)`` works with a local model (one process) and
with a cluster model (``load_model(..., replicas=N)``: replicas capture and write shards in
parallel). Either way the result is the same files: shard ``i`` holds prompts
``[i * shard_size, (i + 1) * shard_size)``, its name is fixed by ``i``, and it is written under a
temporary name and renamed. A rerun with the same arguments skips the finished shards and ends
with the identical dataset; a different build into the same folder is refused unless
``overwrite=True``. See :mod:`.dataset_shard` for the layouts and :mod:`.dataset_manifest` for
the provenance kept beside the shards.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from .address import check_points, format_address
from .dataset_manifest import (FORMAT, MANIFEST, prepare_output, read_manifest, tokenizer_fingerprint,
                               write_json)
from .dataset_prompts import PromptSource
from .dataset_shard import DTYPES, LAYOUTS, ShardSpec, ShardStats, read_tensor, shard_name, write_shard
from .positions import check_prompt, check_spec, spec_to_json, width_bound
from .tokens import InputError


@dataclasses.dataclass(frozen=True)
class ActivationDataset:
    """A finished dataset on disk: where it is, what it holds, and how it was built."""

    path: Path
    manifest: dict
    rows: int
    shards: int
    prompts: int
    tokens: int
    seconds: float
    resumed_shards: int = 0

    @property
    def files(self) -> list[Path]:
        n = self.manifest["identity"]["n_shards"]
        return [self.path / shard_name(i, n) for i in range(n)]

    def to_arrow(self):
        return pq.read_table([str(f) for f in self.files])

    def to_pandas(self):
        return self.to_arrow().to_pandas()

    def to_ray(self):
        """The dataset as a Ray Dataset (needs a connected or local Ray)."""
        import ray.data

        return ray.data.read_parquet([str(f) for f in self.files])

    def tensor(self, point) -> "object":
        """One point's column as a torch tensor ``[rows, ...]`` in its stored dtype."""
        return read_tensor(self.to_arrow(), format_address(point) if not isinstance(point, str) else point)

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else float("nan")
        return (f"{self.rows} rows in {self.shards} shards ({self.prompts} prompts, {self.tokens} tokens, "
                f"{rate:.0f} tokens/s) at {self.path}")


def build_dataset(
    model,
    prompts,
    points,
    output,
    *,
    layout: str = "sequence",
    dtype: str | None = None,
    shard_size: int = 64,
    overwrite: bool = False,
    text_key: str = "text",
    progress: bool = True,
    positions=None,
) -> ActivationDataset:
    """Capture ``points`` for every prompt and write them under ``output`` as Parquet.

    ``prompts``: a list of strings, a ``.jsonl``/``.parquet`` path (field ``text_key``) or a Ray
    Dataset. ``layout``: ``"sequence"`` (a row per prompt) or ``"token"`` (a row per position).
    ``dtype``: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (default: the model's own, so a
    bf16 model is stored bit for bit). ``positions``: keep only those positions of each prompt,
    as ``run_with_cache(..., positions=...)`` does (``-1``: a probe dataset of last tokens; the
    ``"token"`` layout gets one row per kept position, the ``"sequence"`` layout a ``positions``
    column). Every argument is checked, and the prompts read once, before any capture starts.
    """
    from .version import VERSION as __version__

    started = time.perf_counter()
    if layout not in LAYOUTS:
        raise InputError(f"unknown layout {layout!r}; use 'sequence' (a row per prompt) or 'token' (a row per position)")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise InputError(f"shard_size must be a positive int, got {shard_size!r}")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    stored = dtype or (model.dtype if model.dtype in DTYPES else "float32")
    addresses = check_points(points, model.info, model.backend, model.unserved)
    if layout == "token" and any(a.name == "pattern" for a in addresses):
        raise InputError("'pattern' is [heads, q_pos, k_pos] and has no per-token row; use layout='sequence'")
    selection = check_spec(positions)
    if selection == "generated":
        raise InputError("positions='generated' does not apply to datasets (they capture prompts only)")
    source = PromptSource.of(prompts, text_key)
    seen = iter(range(1 << 62))

    def encode(text):  # each prompt's positions are checked as it is scanned
        ids = model.tok.encode(text)
        check_prompt(selection, len(ids), f"prompt {next(seen)}")
        return ids

    scan = source.scan(encode, model.info.n_ctx)
    n_shards = -(-scan.count // shard_size)
    identity = {
        "format": FORMAT,
        "model": model.name,
        "backend": model.backend,
        **_model_facts(model),
        "tokenizer_sha256": tokenizer_fingerprint(model.tok.hf),
        "package_version": __version__,
        "points": [format_address(a) for a in addresses],
        "layout": layout,
        "dtype": stored,
        "prompts_sha256": scan.sha256,
        "n_prompts": scan.count,
        "max_length": scan.max_length,
        **({"positions": spec_to_json(selection)} if selection is not None else {}),
        "shard_size": shard_size,
        "n_shards": n_shards,
    }
    out = Path(output).expanduser().resolve()
    done = prepare_output(out, identity, n_shards, overwrite=overwrite)
    spec = ShardSpec(str(out), tuple(identity["points"]), layout, stored, scan.max_length, n_shards, shard_size,
                     json.dumps(identity, sort_keys=True), selection,
                     width_bound(selection, scan.max_length) if selection is not None else 0)
    manifest = {"identity": identity, "status": "building", "prompts_source": source.label}
    write_json(out / MANIFEST, manifest)

    stats = list(_existing(out, spec, done))
    bar = _progress(progress, scan, stats)
    t0 = time.perf_counter()
    new_tokens = 0
    for shard in _run_shards(model, spec, source, done):
        stats.append(shard)
        new_tokens += shard.tokens
        if bar is not None:
            bar.update(shard.prompts)
            bar.set_postfix(tokens_per_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    if bar is not None:
        bar.close()
    if len(stats) != n_shards:
        raise RuntimeError(f"[Internal] {len(stats)} of {n_shards} shards were written; rerun to resume")
    rows = sum(s.rows for s in stats)
    seconds = time.perf_counter() - started
    result = {"rows": rows, "shards": n_shards, "prompts": scan.count, "tokens": scan.tokens,
              "files": [shard_name(i, n_shards) for i in range(n_shards)]}
    write_json(out / MANIFEST, {**manifest, "status": "complete", "result": result})
    return ActivationDataset(out, read_manifest(out), rows, n_shards, scan.count, scan.tokens, seconds, len(done))


def _run_shards(model, spec: ShardSpec, source: PromptSource, done: set[int]) -> Iterator[ShardStats]:
    if hasattr(model, "write_shards"):  # a cluster model: replicas write the shards
        yield from model.write_shards(spec, source, done)
        return
    for index, texts in source.shards(spec.shard_size, done):
        yield write_shard(model, spec, index, texts)


def _existing(out: Path, spec: ShardSpec, done: set[int]) -> Iterator[ShardStats]:
    for index in sorted(done):
        meta = pq.read_metadata(out / shard_name(index, spec.n_shards))
        prompts = min(spec.shard_size, spec_prompts(spec) - index * spec.shard_size)
        tokens = _tokens_in(out / shard_name(index, spec.n_shards), spec.layout, meta.num_rows)
        yield ShardStats(index, prompts, tokens, meta.num_rows, (out / shard_name(index, spec.n_shards)).stat().st_size)


def spec_prompts(spec: ShardSpec) -> int:
    return json.loads(spec.metadata)["n_prompts"]


def _tokens_in(path: Path, layout: str, rows: int) -> int:
    if layout == "token":
        return rows
    return int(pq.read_table(path, columns=["length"]).column("length").to_numpy().sum())


def _progress(enabled: bool, scan, stats: list[ShardStats]):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=scan.count, initial=sum(s.prompts for s in stats), unit="prompt", desc="build_dataset",
                dynamic_ncols=True)


def _model_facts(model) -> dict:
    """Weights hash and dtype, as every model reports them (a cluster model: from a replica)."""
    facts = model.facts()
    return {"weights_sha256": facts["weights_sha256"], "model_dtype": facts["model_dtype"]}
