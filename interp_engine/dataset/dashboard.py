"""Feature dashboards: stream a prompt set through a model with one or more dictionaries and
write, for every feature, what a person needs to read it.

``feature_dashboard(model, prompts, saes, output)`` runs on any backend that runs dictionaries
(eager, vLLM): each shard of prompts is captured in padded batches (the dictionaries' features
encoded where the activations are made, :mod:`interp_engine.features.run`), tallied
(:mod:`interp_engine.features.tally`) and its tallies
published as two Parquet files; the tallies are then merged, exactly, into

- ``features.parquet``: one row per feature of every dictionary — ``sae``, ``site``, ``feature``,
  ``n_fired`` (tokens it fires on), ``frequency`` (``n_fired`` / tokens), ``max_activation``,
  ``mean_activation`` (over the tokens it fires on), ``quantiles`` (its activation at the 10, 25,
  50, 75 and 90th percentiles, estimated from a uniform sample of those tokens);
- ``contexts.parquet``: per feature its ``top_k`` contexts (``kind`` ``"top"``, ``rank`` 0 the
  largest) and a uniform sample of ``samples`` firing contexts (``kind`` ``"sample"``, ranked by
  activation: the quantile samples), each with ``activation``, ``prompt_index``, ``position``
  and a token window (``tokens``, ``token_strs``, the feature's activation at each, ``acts``;
  ``window_start`` is the window's first position).

A rerun with the same arguments skips the shards already published (``_dashboard.json`` holds
the build's identity; a different build into the same folder is refused unless
``overwrite=True``) and ends with the same files. pandas and DuckDB read them as they are;
:func:`render_html` shows one feature's contexts with each token shaded by its activation.
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..errors import DatasetExistsError, InputError
from ..scalars import integer
from ..features.plan import as_dictionaries, check_saes, describe
from ..features.tally import merge_contexts, merge_stats, tally

FORMAT = "interp_engine.dashboard/1"
MANIFEST = "_dashboard.json"
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
KINDS = ("top", "sample")


@dataclasses.dataclass(frozen=True)
class Dashboard:
    """A finished dashboard: its folder, the counts, and readers."""

    path: str
    identity: dict
    tokens: int
    seconds: float
    resumed_shards: int = 0

    def features(self) -> pa.Table:
        return pq.read_table(f"{self.path}/features.parquet")

    def contexts(self) -> pa.Table:
        return pq.read_table(f"{self.path}/contexts.parquet")

    def html(self, feature: int, sae: str | None = None, kind: str = "top") -> str:
        """One feature's contexts as HTML (see :func:`render_html`)."""
        return render_html(self.contexts(), feature, sae or self.identity["saes"][0]["name"], kind)


def feature_dashboard(model, prompts, saes, output, *, top_k: int = 20, samples: int = 20,
                      window: tuple[int, int] = (8, 4), shard_size: int = 64, batch_tokens: int = 4096,
                      text_key: str = "text", overwrite: bool = False, progress: bool = False) -> Dashboard:
    """Write a dashboard of every feature of ``saes`` over ``prompts`` (a list of strings, or a
    ``.jsonl`` / ``.parquet`` path with field ``text_key``) under ``output`` (a folder or URI);
    see the module docstring. ``window``: tokens shown before and after each context's token."""
    from ..batching import plan_batches, run_padded
    from ..tokens import pad_batch
    from .prompts import PromptSource
    from .store import Store

    started = time.perf_counter()
    dictionaries = as_dictionaries(saes)
    if not dictionaries:
        raise InputError("feature_dashboard needs at least one dictionary: saes=[load_dictionary(path)]")
    names = [d.name or f"sae{i}" for i, d in enumerate(dictionaries)]
    if len(set(names)) != len(names):
        raise InputError(f"the dictionaries' names must differ (they name the dashboard's rows), got {names}")
    points = [f"{d.reads}.features" for d in dictionaries]
    check_saes(model, model.check_points(points), dictionaries)
    for name, value in (("top_k", top_k), ("samples", samples), ("shard_size", shard_size)):
        if integer(value) is None or integer(value) < (0 if name == "samples" else 1):
            raise InputError(f"{name} must be a positive int, got {value!r}")
    top_k, samples, shard_size = integer(top_k), integer(samples), integer(shard_size)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(integer(w) is not None and integer(w) >= 0 for w in window)):
        raise InputError(f"window must be (tokens before, tokens after), two ints >= 0, got {window!r}")
    window = tuple(integer(w) for w in window)
    source = PromptSource.of(prompts, text_key)
    scan = source.scan(model.tok.encode, model.info.n_ctx, shard_size)
    n_shards = -(-scan.count // shard_size)
    identity = {"format": FORMAT, "model": model.name, "prompts_sha256": scan.sha256, "n_prompts": scan.count,
                "saes": [{**entry, "name": name} for entry, name in zip(describe(dictionaries), names)],
                "top_k": top_k, "samples": samples, "window": list(window), "shard_size": shard_size,
                "n_shards": n_shards}
    store = Store.of(output)
    store.make_root()
    done = _resume(store, identity, overwrite)
    tag = json.dumps(identity, sort_keys=True).encode()
    bar = _progress(progress, n_shards, len(done))
    for index, texts in source.shards(shard_size, done):
        rows = [model.tok.encode(t) for t in texts]
        stats, contexts = [], []
        lengths = [len(r) for r in rows]
        for batch in plan_batches(lengths, batch_tokens) if model.batched else [list(range(len(rows)))]:
            tokens = pad_batch([rows[i] for i in batch])
            cache = run_padded(model, tokens, points, saes=list(dictionaries))
            ids = torch.tensor([index * shard_size + i for i in batch])
            for j, point in enumerate(points):
                s, c = tally(cache[point], cache.tokens, ids, j, top_k=top_k, samples=samples, window=tuple(window))
                stats.append(s)
                contexts.append(c)
        contexts = merge_contexts(contexts, top_k, samples)
        _publish(store, f"contexts-{index:05d}.parquet", contexts, tag)
        _publish(store, f"stats-{index:05d}.parquet", merge_stats(stats), tag)  # last: the shard's commit record
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    _write_results(store, identity, dictionaries, names, model, scan.tokens, n_shards)
    return Dashboard(store.location() if not store.is_local else store.root, identity, scan.tokens,
                     time.perf_counter() - started, len(done))


def _resume(store, identity: dict, overwrite: bool) -> set[int]:
    """The shards a previous run of this same build published (none after ``overwrite``)."""
    existing = store.list()
    if MANIFEST in existing:
        before = json.loads(store.read(MANIFEST))
        if before.get("identity") != identity:
            if not overwrite:
                raise DatasetExistsError(f"{store.location()} holds another dashboard (different model, prompts, "
                                         f"dictionaries or settings); pick another output or pass overwrite=True")
            for name in existing:
                if name.startswith(("stats-", "contexts-")) or name in ("features.parquet", "contexts.parquet"):
                    store.delete(name)
            existing = store.list()
    elif any(n.endswith(".parquet") for n in existing) and not overwrite:
        raise DatasetExistsError(f"{store.location()} holds Parquet files but no {MANIFEST}; pick an empty output")
    store.write(MANIFEST, json.dumps({"identity": identity, "status": "building"}, indent=1).encode())
    tag = json.dumps(identity, sort_keys=True).encode()
    done = set()
    for index in range(identity["n_shards"]):
        names = (f"stats-{index:05d}.parquet", f"contexts-{index:05d}.parquet")
        if all(n in existing for n in names) and all(_tag(store, n) == tag for n in names):
            done.add(index)
    return done


def _tag(store, name: str) -> bytes | None:
    try:
        return (pq.read_schema(io.BytesIO(store.read(name))).metadata or {}).get(b"interp_engine.dashboard")
    except (OSError, pa.ArrowInvalid):
        return None  # a damaged file: the shard is computed again


def _publish(store, name: str, table: pa.Table, tag: bytes) -> None:
    table = table.replace_schema_metadata({b"interp_engine.dashboard": tag})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    store.write(name, sink.getvalue().to_pybytes())


def _read(store, prefix: str, n_shards: int) -> list[pa.Table]:
    return [pq.read_table(io.BytesIO(store.read(f"{prefix}-{i:05d}.parquet"))).replace_schema_metadata(None)
            for i in range(n_shards)]


def _write_results(store, identity, dictionaries, names, model, tokens: int, n_shards: int) -> None:
    """Merge every shard's tallies into features.parquet and contexts.parquet."""
    stats = merge_stats(_read(store, "stats", n_shards))
    contexts = merge_contexts(_read(store, "contexts", n_shards), identity["top_k"], identity["samples"])
    quantiles = {}
    frame = contexts.select(["dictionary", "feature", "kind", "activation"]).to_pandas()
    for (d, f), group in frame[frame["kind"] == 1].groupby(["dictionary", "feature"]):
        quantiles[(d, f)] = np.quantile(group["activation"].to_numpy(), QUANTILES).astype(np.float32)
    fired = {(int(d), int(f)): (int(n), float(t), float(m)) for d, f, n, t, m in zip(
        *(stats.column(c).to_pylist() for c in ("dictionary", "feature", "n_fired", "total", "max")))}
    columns: dict[str, list] = {k: [] for k in ("sae", "sae_key", "site", "feature", "n_fired", "frequency",
                                                "max_activation", "mean_activation", "quantiles")}
    none = np.zeros(len(QUANTILES), np.float32)
    for j, (d, name) in enumerate(zip(dictionaries, names)):
        for f in range(d.d_sae):
            n, total, peak = fired.get((j, f), (0, 0.0, 0.0))
            for key, value in (("sae", name), ("sae_key", d.key), ("site", str(d.reads)), ("feature", f),
                               ("n_fired", n), ("frequency", n / tokens), ("max_activation", peak),
                               ("mean_activation", total / n if n else 0.0),
                               ("quantiles", quantiles.get((j, f), none).tolist())):
                columns[key].append(value)
    features = pa.table({**columns, "feature": pa.array(columns["feature"], pa.int32()),
                         "max_activation": pa.array(columns["max_activation"], pa.float32()),
                         "mean_activation": pa.array(columns["mean_activation"], pa.float32()),
                         "quantiles": pa.array(columns["quantiles"], pa.list_(pa.float32(), len(QUANTILES)))})
    _publish(store, "features.parquet", features, b"")
    _publish(store, "contexts.parquet", _readable(contexts, names, model), b"")
    store.write(MANIFEST, json.dumps({"identity": identity, "status": "complete", "tokens": tokens}, indent=1).encode())


def _readable(contexts: pa.Table, names: list[str], model) -> pa.Table:
    """The merged contexts as users read them: dictionary names, kinds as words, each kind ranked
    (activation descending, then prompt and position), and the window's tokens as text (each
    distinct token decoded once)."""
    from .columns import to_numpy

    col = {c: contexts.column(c).to_numpy() for c in ("dictionary", "feature", "kind", "activation", "prompt_index",
                                                       "position")}
    order = np.lexsort((col["position"], col["prompt_index"], -col["activation"], col["kind"], col["feature"],
                        col["dictionary"]))
    table = contexts.take(order)
    d, f, kind = (table.column(c).to_numpy() for c in ("dictionary", "feature", "kind"))
    group = (d.astype(np.int64) << 33) | (f.astype(np.int64) << 1) | kind.astype(np.int64)
    starts = np.r_[0, np.flatnonzero(group[1:] != group[:-1]) + 1] if len(group) else np.zeros(0, np.int64)
    rank = np.arange(len(group)) - np.repeat(starts, np.diff(np.r_[starts, len(group)]))
    ids = to_numpy(table.column("tokens"))
    width = ids.shape[1] if ids.ndim == 2 else 0
    distinct, inverse = np.unique(ids, return_inverse=True)
    text = np.array(["" if i < 0 else model.to_string([int(i)]) for i in distinct], dtype=object)
    strs = text[inverse.reshape(-1)] if len(distinct) else np.zeros(0, dtype=object)
    return pa.table({
        "sae": pa.array(np.array(names, dtype=object)[d], pa.string()), "feature": table.column("feature"),
        "kind": pa.array(np.array(KINDS, dtype=object)[kind], pa.string()), "rank": pa.array(rank, pa.int32()),
        "activation": table.column("activation"), "prompt_index": table.column("prompt_index"),
        "position": table.column("position"), "window_start": table.column("window_start"),
        "tokens": table.column("tokens"),
        "token_strs": pa.FixedSizeListArray.from_arrays(pa.array(strs, pa.string()), width),
        "acts": table.column("acts")})


def render_html(contexts: pa.Table, feature: int, sae: str, kind: str = "top") -> str:
    """One feature's contexts (``kind`` ``"top"`` or ``"sample"``) as an HTML fragment: a line per
    context, each token shaded by the feature's activation there relative to its largest one."""
    frame = contexts.to_pandas()
    frame = frame[(frame["sae"] == sae) & (frame["feature"] == feature) & (frame["kind"] == kind)]
    if not len(frame):
        return f"<p>{html.escape(sae)} feature {feature}: no {kind} contexts (it never fired)</p>"
    frame = frame.sort_values("rank")
    peak = max(float(frame["activation"].max()), 1e-12)
    lines = [f"<h3>{html.escape(sae)} feature {feature} ({kind} contexts)</h3>"]
    for _, row in frame.iterrows():
        spans = []
        for token, act, tid in zip(row["token_strs"], row["acts"], row["tokens"]):
            if tid < 0:
                continue
            alpha = max(0.0, min(1.0, float(act) / peak))
            spans.append(f'<span style="background: rgba(255, 120, 0, {alpha:.3f})" title="{float(act):.4g}">'
                         f"{html.escape(token)}</span>")
        lines.append(f'<p><b>{float(row["activation"]):.4g}</b> prompt {row["prompt_index"]} '
                     f'position {row["position"]}: {"".join(spans)}</p>')
    return "\n".join(lines)


def _progress(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, unit="shard", desc="feature_dashboard", dynamic_ncols=True)
