"""Activation datasets: capture points over a prompt set and write them as Parquet shards.

``build_dataset(model, prompts, points, output)`` works with a local model (one process) and
with a cluster model (``load_model(..., replicas=N)``: replicas capture and write shards in
parallel). Either way the result is the same files: shard ``i`` holds prompts
``[i * shard_size, (i + 1) * shard_size)``, its name is fixed by ``i``, and it is published
atomically on any store (:mod:`.store`). A rerun with the same arguments checks the
shards already there (:mod:`.integrity`), rewrites any that fail, skips the rest and
ends with the identical dataset; a different build into the same folder is refused unless
``overwrite=True``, and a build while another is writing there is refused (:mod:`.lease`). See :mod:`.shard` for the layouts and :mod:`.manifest` for
the provenance kept beside the shards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from ..address import format_address
from .integrity import Expected, identity_json, verify_existing
from .lease import Lease, inspect_free_output
from .manifest import FORMAT, prepare_output, tokenizer_fingerprint, write_manifest
from .prompts import PromptSource
from .result import ActivationDataset as ActivationDataset
from .result import where
from .shard import BATCH_TOKENS, DTYPES, LAYOUTS, ShardSpec, ShardStats, shard_name
from .store import Store
from .writer import MAX_WRITERS, ShardWriter, write_shards
from .uri import check_access, check_writable
from ..request import Points
from ..positions import check_prompt, check_spec, resolve_row, width_bound
from ..wire import spec_to_json
from ..protocol import WritesShards
from ..errors import InputError, InternalError
from ..scalars import integer
from ..features.plan import describe, check_saes

_SAVE_EVERY_S = 1.0  # how often the manifest's shard records are saved while building


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
    filesystem=None,
    shuffle: bool = False,
    seed: int = 0,
    writers: int = 1,
    batch_tokens: int = BATCH_TOKENS,
    saes=None,
) -> ActivationDataset:
    """Capture ``points`` for every prompt and write them under ``output`` as Parquet.

    ``prompts``: a list of strings, a ``.jsonl``/``.parquet`` path (field ``text_key``) or a Ray
    Dataset. ``layout``: ``"sequence"`` (a row per prompt) or ``"token"`` (a row per position).
    ``dtype``: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (default: the model's own, so a
    bf16 model is stored bit for bit). ``positions``: keep only those positions of each prompt,
    as ``run_with_cache(..., positions=...)`` does (``-1``: a probe dataset of last tokens; the
    ``"token"`` layout gets one row per kept position, the ``"sequence"`` layout a ``positions``
    column). ``output``: a local path, a URI (``s3://bucket/prefix``, ``gs://...``,
    ``file://...``) or ``(pyarrow.fs.FileSystem, path)``; ``filesystem=`` gives the filesystem
    explicitly. ``shuffle=True``: shard ``i`` holds a fixed random set of prompts (``seed``) and
    its token rows are permuted, so rows mix tokens of many sequences; a rerun writes the same
    files. ``writers``: how many shards are encoded, hashed and written at once, beside the
    capture of the next (raise it when one writer cannot keep up with the model, e.g. a GPU or a
    slow upload; see :mod:`.writer`). ``batch_tokens``: a batched (eager) model captures
    a shard in padded batches of similar lengths of at most this many padded tokens (a vLLM
    model gets every prompt in flight at once; see :func:`~.batching.plan_batches`). ``saes``:
    dictionaries whose feature points ``points`` may name (``"resid_post.3.features"`` is stored
    sparse: a list of active feature ids and one of values per token; a subset
    ``features[5,17]`` and ``sae_error`` are dense columns; see :mod:`interp_engine.features`),
    encoded where the model makes the activations. Every argument is checked, the prompts read once and the destination probed before any capture
    starts.
    """
    from ..version import VERSION as __version__

    started = time.perf_counter()
    if layout not in LAYOUTS:
        raise InputError(f"unknown layout {layout!r}; use 'sequence' (a row per prompt) or 'token' (a row per position)")
    if integer(shard_size) is None or integer(shard_size) < 1:
        raise InputError(f"shard_size must be a positive int, got {shard_size!r}")
    if not isinstance(shuffle, bool):
        raise InputError(f"shuffle must be True or False, got {shuffle!r}")
    if integer(seed) is None or integer(seed) < 0:
        raise InputError(f"seed must be an int >= 0, got {seed!r}")
    if integer(writers) is None or not 1 <= integer(writers) <= MAX_WRITERS:
        raise InputError(f"writers must be an int from 1 to {MAX_WRITERS} (shards written at once), got {writers!r}")
    if integer(batch_tokens) is None or integer(batch_tokens) < 1:
        raise InputError(f"batch_tokens must be a positive int (padded tokens per forward), got {batch_tokens!r}")
    shard_size, seed, writers, batch_tokens = map(integer, (shard_size, seed, writers, batch_tokens))
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    stored = dtype or (model.dtype if model.dtype in DTYPES else "float32")
    addresses = Points.check(points, model.info, model.capabilities)  # once: shards trust them
    dictionaries = check_saes(model, addresses, saes)
    wide = [a for a in addresses if len(a.position_axes) > 1]
    if layout == "token" and wide:
        raise InputError(f"{wide[0].name!r} is [heads, q_pos, k_pos] and has no per-token row; use layout='sequence'")
    selection = check_spec(positions)
    if selection == "generated":
        raise InputError("positions='generated' does not apply to datasets (they capture prompts only)")
    store = Store.of(output, filesystem)  # the name only: no I/O yet
    source = PromptSource.of(prompts, text_key)
    seen = iter(range(1 << 62))

    def encode(text):  # each prompt's positions are checked as it is scanned
        ids = model.tok.encode(text)
        check_prompt(selection, len(ids), f"prompt {next(seen)}")
        return ids

    scan = source.scan(encode, model.info.n_ctx, shard_size)
    n_shards = -(-scan.count // shard_size)
    identity = {
        "format": FORMAT,
        "model": model.name,
        "backend": model.backend,
        **_model_facts(model),
        "tokenizer_sha256": tokenizer_fingerprint(model.tok.hf),
        "package_version": __version__,
        "points": [format_address(a) for a in addresses],
        **({"saes": describe(dictionaries)} if dictionaries else {}),
        "layout": layout,
        "dtype": stored,
        "prompts_sha256": scan.sha256,
        "n_prompts": scan.count,
        "max_length": scan.max_length,
        **({"positions": spec_to_json(selection)} if selection is not None else {}),
        "shard_size": shard_size,
        "n_shards": n_shards,
        "shuffle_seed": seed if shuffle else None,
    }
    check_access(store, explicit=filesystem is not None or isinstance(output, tuple))
    inspect_free_output(store, identity, overwrite=overwrite)  # the refusals, before anything is written
    check_writable(store)
    lease = Lease.acquire(store)  # one build at a time in this folder (see dataset_lease)
    try:
        return _build(model, store, source, scan, identity, selection, lease, overwrite=overwrite,
                      progress=progress, started=started, writers=writers, batch_tokens=batch_tokens,
                      saes=dictionaries)
    finally:
        lease.release()


def _build(model, store: Store, source: PromptSource, scan, identity: dict, selection, lease: Lease, *,
           overwrite: bool, progress: bool, started: float, writers: int, batch_tokens: int,
           saes: tuple = ()) -> ActivationDataset:
    """The build proper, with the folder's lease held: clean up, check what a resume keeps,
    capture the missing shards, and record each in the manifest."""
    n_shards, shard_size, layout, stored = identity["n_shards"], identity["shard_size"], identity["layout"], identity["dtype"]
    records, present, sizes = prepare_output(store, identity, n_shards, overwrite=overwrite)
    spec = ShardSpec(store, tuple(identity["points"]), layout, stored, scan.max_length, n_shards, shard_size,
                     identity_json(identity), positions=selection,
                     held=width_bound(selection, scan.max_length) if selection is not None else 0,
                     n_prompts=scan.count, shuffle_seed=identity["shuffle_seed"], batch_tokens=batch_tokens,
                     writers=writers, saes=saes)
    shard_tokens = _shard_tokens(scan, spec)
    expected = {i: Expected(_shard_rows(shard_tokens, scan, spec, i), spec.metadata) for i in present}
    good, repaired = verify_existing(store, present, sizes, records, expected)
    manifest = {"identity": identity, "status": "building", "prompts_source": source.label,
                "build_id": lease.build_id, "shards": {shard_name(i, n_shards): rec for i, rec in good.items()}}
    lease.check()
    write_manifest(store, manifest)

    stats = [ShardStats(i, _shard_prompts(scan, i, shard_size), shard_tokens[i], rec["rows"], rec["bytes"],
                        rec["sha256"]) for i, rec in sorted(good.items())]
    bar = _progress(progress, scan, stats)
    t0 = last_saved = time.perf_counter()
    new_tokens = 0
    phases: dict[str, float] = {}
    for shard in _run_shards(model, spec, source, set(good)):
        stats.append(shard)
        for phase, seconds in shard.times.items():
            phases[phase] = phases.get(phase, 0) + seconds
        manifest["shards"][shard_name(shard.index, n_shards)] = shard.record()
        new_tokens += shard.tokens
        if time.perf_counter() - last_saved > _SAVE_EVERY_S:  # records survive a driver kill
            lease.check()
            write_manifest(store, manifest)
            last_saved = time.perf_counter()
        if bar is not None:
            bar.update(shard.prompts)
            bar.set_postfix(tokens_per_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    if bar is not None:
        bar.close()
    if len(stats) != n_shards:
        raise InternalError(f"[Internal] {len(stats)} of {n_shards} shards were written; rerun to resume")
    rows = sum(s.rows for s in stats)
    seconds = time.perf_counter() - started
    result = {"rows": rows, "shards": n_shards, "prompts": scan.count, "tokens": scan.tokens,
              "files": [shard_name(i, n_shards) for i in range(n_shards)]}
    manifest.update(status="complete", result=result)
    lease.check()
    write_manifest(store, manifest)
    return ActivationDataset(where(store), manifest, rows, n_shards, scan.count, scan.tokens, seconds, len(good),
                             tuple(repaired), store, phases, new_tokens)


def _run_shards(model, spec: ShardSpec, source: PromptSource, done: set[int]) -> Iterator[ShardStats]:
    if isinstance(model, WritesShards):  # a cluster model: replicas write the shards
        yield from model.write_shards(spec, source, done)
        return
    yield from write_shards(ShardWriter(model), spec, source.shards(spec.shard_size, done, spec.order()))


def _shard_prompts(scan, index: int, shard_size: int) -> int:
    return min(shard_size, scan.count - index * shard_size)


def _shard_tokens(scan, spec: ShardSpec) -> list[int]:
    order = spec.order()
    if order is None:
        return list(scan.shard_tokens)
    lengths = np.frombuffer(scan.lengths, dtype=np.int32) if len(scan.lengths) else np.zeros(0, np.int32)
    return [int(lengths[order[i * spec.shard_size:(i + 1) * spec.shard_size]].sum()) for i in range(spec.n_shards)]


def _shard_rows(shard_tokens, scan, spec: ShardSpec, index: int) -> int:
    """The rows shard ``index`` holds: one per prompt, or one per kept token (with ``positions=``,
    the positions each of its prompts keeps)."""
    if spec.layout != "token":
        return _shard_prompts(scan, index, spec.shard_size)
    if spec.positions is None:
        return shard_tokens[index]
    lengths = np.frombuffer(scan.lengths, dtype=np.int32)
    ids = spec.prompt_ids(index, _shard_prompts(scan, index, spec.shard_size))
    return sum(len(resolve_row(spec.positions, int(lengths[i]))) for i in ids)


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
