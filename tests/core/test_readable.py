"""Readable objects (issue 26, items 10 and 11): a model, a cache and a dataset print as what they
are in one line — never their modules, values or whole manifest — and a resumed build's summary
says how many shards it resumed and rates only the work it did. tests/vllm/test_tl_vllm.py and
tests/cluster/replicas/test_tl_cluster.py check the vLLM and cluster model reprs."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from interp_engine import build_dataset, run_with_cache


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


def test_a_model_prints_as_name_layers_dtype_and_device(model):
    name = model.name.rstrip("/").rsplit("/", 1)[-1]
    assert repr(model) == f"EagerModel({name!r}, {model.n_layers} layers, float32, cpu)"


def test_a_cache_prints_its_addresses_and_shapes_summarised(model):
    tokens = model.to_tokens(["one prompt", "and a second one"])
    small = run_with_cache(model, tokens, ["resid_post.1", "z.0"])
    width = tokens.shape[1]
    name = model.name.rstrip("/").rsplit("/", 1)[-1]
    assert repr(small) == (f"Cache({name!r}, eager, 2 x {width} tokens, 2 addresses: resid_post.1 [2, {width}, "
                           f"{model.d_model}], z.0 [2, {width}, {model.n_heads}, {model.d_head}])")
    big = run_with_cache(model, tokens, ["resid_post", "mlp_out", "attn_out", "logits"])
    text = repr(big)
    n = len(big)
    assert f"{n} addresses: resid_post.0 [" in text and f"... {n - 5} more, logits [2, {width}, " in text
    assert text.count("[") == 5 and len(text) < 400
    held = repr(big.select(-1))
    assert "2 x" in held and "1 positions held" in held


def test_a_dataset_prints_its_place_size_and_points_and_a_resume_rates_its_own_work(model, tmp_path):
    prompts = [f"prompt {i} " + "word " * (i % 4) for i in range(9)]
    first = build_dataset(model, prompts, ["resid_post.1", "z.0"], tmp_path / "d", layout="token", shard_size=3,
                          progress=False)
    assert repr(first) == (f"ActivationDataset({str(tmp_path / 'd')!r}, {first.rows} rows, 3 shards, "
                           f"points: resid_post.1, z.0)")
    assert "resumed" not in first.summary() and f"{first.tokens} tokens" in first.summary()
    lost = pq.read_table(first.files[1]).num_rows  # token layout: one row per token
    first.files[1].unlink()
    again = build_dataset(model, prompts, ["resid_post.1", "z.0"], tmp_path / "d", layout="token", shard_size=3,
                          progress=False)
    summary = again.summary()
    assert "3 shards (2 resumed from an earlier run, 1 written now" in summary
    rate = re.search(r"; (\d+) tokens/s over the (\d+) tokens written now\)", summary)
    assert rate and int(rate.group(2)) == lost < again.tokens
    assert int(rate.group(1)) == round(lost / again.seconds)
