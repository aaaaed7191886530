"""Feature dashboards: the merged per-feature top contexts, firing counts and maxima equal a brute
force over the same captures; samples are uniform draws of firing tokens; the files are read by
pandas and DuckDB; a rerun resumes and gives the same files; one feature renders as HTML."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp_engine.errors import DatasetExistsError
from interp_engine.dataset.dashboard import feature_dashboard, render_html
from interp_engine import run_with_cache
from interp_engine.tokens import pad_batch

from .. import sparse_dicts as sd

PROMPTS = [f"Prompt number {i} says " + "something " * (i % 5) + "and stops." for i in range(9)]
SHARD = 4
TOP, WINDOW = 5, (3, 2)


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def built(model, tmp_path_factory):
    saes = [sd.sae(k=10), sd.sae("mlp_out.0", seed=2, jumprelu=True)]
    out = tmp_path_factory.mktemp("dash") / "d"
    return saes, out, feature_dashboard(model, PROMPTS, saes, out, top_k=TOP, samples=4, window=WINDOW,
                                        shard_size=SHARD)


def brute_force(model, sae):
    """Every (activation, prompt, position) of every feature, from the capture of each shard's batch."""
    found = {}
    for first in range(0, len(PROMPTS), SHARD):
        tokens = pad_batch([model.tok.encode(p) for p in PROMPTS[first:first + SHARD]])
        f = run_with_cache(model, tokens, [f"{sae.reads}.features"], saes=sae)[f"{sae.reads}.features"]
        for b, p, j in (f != 0).nonzero().tolist():
            found.setdefault(j, []).append((float(f[b, p, j]), first + b, p, tokens[b]))
    return found


def test_top_contexts_counts_and_maxima_equal_brute_force(model, built):
    saes, _, dash = built
    features, contexts = dash.features().to_pandas(), dash.contexts().to_pandas()
    total = sum(len(model.tok.encode(p)) for p in PROMPTS)
    assert dash.tokens == total
    for sae, name in zip(saes, ["sae0", "sae2"]):
        found = brute_force(model, sae)
        rows = features[features["sae"] == name].set_index("feature")
        assert len(rows) == sae.d_sae and rows.loc[list(found)]["n_fired"].gt(0).all()
        for j in range(sae.d_sae):
            hits = found.get(j, [])
            assert rows.loc[j, "n_fired"] == len(hits)
            assert rows.loc[j, "frequency"] == len(hits) / total
            if not hits:
                continue
            assert rows.loc[j, "max_activation"] == pytest.approx(max(h[0] for h in hits), rel=1e-6)
            want = sorted(hits, key=lambda h: (-h[0], h[1], h[2]))[:TOP]
            got = contexts[(contexts["sae"] == name) & (contexts["feature"] == j) & (contexts["kind"] == "top")]
            got = got.sort_values("rank")
            assert [(r.prompt_index, r.position) for r in got.itertuples()] == [(h[1], h[2]) for h in want]
            assert got["activation"].tolist() == pytest.approx([h[0] for h in want], rel=1e-6)
            act, prompt, pos, tokens = want[0]
            first = got.iloc[0]
            assert first["window_start"] == pos - WINDOW[0]
            for k, tid in enumerate(first["tokens"]):
                at = pos - WINDOW[0] + k
                assert tid == (int(tokens[at]) if 0 <= at < int((tokens >= 0).sum()) else -1)
            assert first["acts"][WINDOW[0]] == pytest.approx(act, rel=1e-6)


def test_samples_are_firing_contexts_and_quantiles_lie_within_them(built):
    saes, _, dash = built
    features, contexts = dash.features().to_pandas(), dash.contexts().to_pandas()
    samples = contexts[contexts["kind"] == "sample"]
    assert (samples["activation"] > 0).all()
    per = samples.groupby(["sae", "feature"]).size()
    fired = features.set_index(["sae", "feature"])["n_fired"]
    assert (per == fired.loc[per.index].clip(upper=4)).all()  # min(samples, times it fired)
    row = features[features["n_fired"] >= 4].iloc[0]
    acts = samples[(samples["sae"] == row["sae"]) & (samples["feature"] == row["feature"])]["activation"]
    assert acts.min() <= min(row["quantiles"]) <= max(row["quantiles"]) <= acts.max()


def test_samples_are_the_least_hash_of_every_firing_token(model, built):
    """A feature's samples are the 4 tokens of least hash among all the tokens it fires on, over
    every shard (a bottom-k sample: merging shards keeps it)."""
    from interp_engine.features.tally import mix

    saes, _, dash = built
    contexts = dash.contexts().to_pandas()
    for d, (sae, name) in enumerate(zip(saes, ["sae0", "sae2"])):
        for j, hits in brute_force(model, sae).items():
            keys = np.array([[d, j, h[1], h[2]] for h in hits])
            least = np.argsort(mix(*keys.T), kind="stable")[:4]
            got = contexts[(contexts["sae"] == name) & (contexts["feature"] == j) & (contexts["kind"] == "sample")]
            assert sorted(zip(got["prompt_index"], got["position"])) == sorted((hits[i][1], hits[i][2]) for i in least)


def test_the_least_hash_sample_is_uniform():
    """Bottom-k by the dashboard's hash is a uniform sample: over 400 features firing on the same
    1,000 tokens, each token is picked about equally often and the picks' mean position is central."""
    from interp_engine.features.tally import mix

    features, positions = np.repeat(np.arange(400), 1000), np.tile(np.arange(1000), 400)
    hashed = mix(np.zeros_like(features), features, np.zeros_like(features), positions)
    order = np.lexsort((hashed, features)).reshape(400, 1000)[:, :25]  # 25 samples of each feature
    picked = positions[order].ravel()
    counts = np.bincount(picked // 100, minlength=10)  # 10,000 picks in 10 bins of 100 positions
    assert counts.min() > 850 and counts.max() < 1150, counts
    assert abs(picked.mean() - 499.5) < 10


def test_duckdb_reads_the_dashboard(built):
    import duckdb

    _, out, dash = built
    n, top = duckdb.sql(f"""SELECT count(*), max(max_activation) FROM read_parquet('{out}/features.parquet')
                            WHERE sae = 'sae0'""").fetchall()[0]
    assert n == sd.D_SAE and top == pytest.approx(float(dash.features().to_pandas().query("sae == 'sae0'")
                                                        ["max_activation"].max()))
    assert duckdb.sql(f"""SELECT count(*) FROM read_parquet('{out}/contexts.parquet')
                          WHERE kind = 'top' AND rank = 0""").fetchall()[0][0] == int(
        (dash.features().to_pandas()["n_fired"] > 0).sum())


def test_a_rerun_resumes_and_writes_the_same_files(model, built):
    saes, out, dash = built
    before = (out / "features.parquet").read_bytes(), (out / "contexts.parquet").read_bytes()
    (out / "stats-00001.parquet").unlink()
    again = feature_dashboard(model, PROMPTS, saes, out, top_k=TOP, samples=4, window=WINDOW, shard_size=SHARD)
    assert again.resumed_shards == 2
    assert ((out / "features.parquet").read_bytes(), (out / "contexts.parquet").read_bytes()) == before
    with pytest.raises(DatasetExistsError, match="another dashboard"):
        feature_dashboard(model, PROMPTS, saes, out, top_k=TOP + 1, samples=4, window=WINDOW, shard_size=SHARD)


def test_one_feature_renders_as_html(built):
    _, _, dash = built
    features = dash.features().to_pandas()
    j = int(features[features["sae"] == "sae0"].sort_values("n_fired").iloc[-1]["feature"])
    page = dash.html(j)
    assert page.count("<p>") == TOP and "background: rgba(255, 120, 0, 1.000)" in page
    assert "never fired" in render_html(dash.contexts(), 10**6, "sae0")


def test_the_job_builds_a_dashboard_from_a_config(tiny_path, tmp_path, capsys):
    import json

    from safetensors.torch import save_file

    from interp_engine.jobs.feature_dashboard import main

    sae = sd.sae(k=6)
    folder = tmp_path / "saes" / "l1"
    folder.mkdir(parents=True)
    save_file({k: getattr(sae, k).contiguous() for k in ("W_enc", "b_enc", "W_dec", "b_dec")},
              str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({
        "d_in": sd.D_MODEL, "d_sae": sd.D_SAE, "architecture": "topk", "k": 6, "apply_b_dec_to_input": False,
        "normalize_activations": "none", "dtype": "float32",
        "metadata": {"sae_lens_version": "6.54.12", "hook_name": "blocks.1.hook_resid_post"}}))
    config = tmp_path / "dash.yaml"
    config.write_text(f"model: {tiny_path('llama')}\nprompts: {json.dumps(PROMPTS[:5])}\n"
                      f"saes:\n  - path: saes/l1\n    name: l1\noutput: {tmp_path / 'out'}\ntop_k: 3\n"
                      f"shard_size: 2\nprogress: false\n")
    assert main([str(config)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["features"] == sd.D_SAE and summary["tokens"] == sum(len(p) + 1 for p in PROMPTS[:5])
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "out" / "contexts.parquet")
    assert set(frame["sae"]) == {"l1"} and frame[frame["kind"] == "top"].groupby("feature").size().max() == 3
    config.write_text(config.read_text().replace("top_k: 3", "top_k: 0"))
    assert main([str(config)]) == 2 and "top_k" in capsys.readouterr().err
