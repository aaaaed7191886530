"""Every model states its facts the same way: ``model.dtype`` and ``model.facts()`` (what a dataset
manifest records), so a dataset built from a bf16 model says bf16 and stores bf16 by default on
every backend — a vLLM model once recorded float32 because it had no ``dtype`` to read."""

from __future__ import annotations

import pytest
import torch

from interp_engine import build_dataset, load_model
from interp_engine.dataset.shard import read_tensor
from interp_engine.fingerprint import weights_fingerprint


def test_eager_facts(tiny_path):
    path = tiny_path("llama")
    for dtype in ("float32", "bfloat16"):
        model = load_model(str(path), dtype=dtype)
        assert model.dtype == dtype == str(model.hf.dtype).removeprefix("torch.")
        assert model.facts() == {"model_dtype": dtype, "weights_sha256": weights_fingerprint(path)}


def test_a_bf16_vllm_dataset_records_and_stores_bf16(tiny_path, tmp_path):
    pytest.importorskip("vllm")
    path = tiny_path("llama")
    with load_model(str(path), backend="vllm", dtype="bfloat16", max_model_len=64) as model:
        assert model.dtype == "bfloat16"
        assert model.facts() == {"model_dtype": "bfloat16", "weights_sha256": weights_fingerprint(path)}
        ds = build_dataset(model, ["a bf16 prompt", "another"], ["resid_post.1"], tmp_path / "d", progress=False)
    assert ds.manifest["identity"]["model_dtype"] == "bfloat16"
    assert read_tensor(ds.to_arrow(), "resid_post.1").dtype == torch.bfloat16
