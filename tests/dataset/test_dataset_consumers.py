"""One schema that every consumer reads: the same dataset through pyarrow, pandas, DuckDB and
Hugging Face ``datasets`` (torch format) equals our own reader, for float32, float16 and bf16
(bf16 as exact float32 values). Ray Data is checked in test_dataset_ray.py."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from interp_engine import build_dataset, load_model
from interp_engine.dataset.columns import column_shape, to_numpy
from interp_engine.dataset.shard import read_tensor

PROMPTS = [f"Row {i}: " + "red green blue " * (1 + i % 3) for i in range(7)]


@pytest.fixture(scope="module")
def datasets_built(tiny_path, eager_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("consumers")
    bf16 = load_model(str(tiny_path("llama")), dtype="bfloat16")
    fp32 = eager_models("llama")
    return {
        "bf16-token": build_dataset(bf16, PROMPTS, ["resid_post.1", "z.0"], root / "bf16", layout="token",
                                    shard_size=3, progress=False),
        "f16-token": build_dataset(fp32, PROMPTS, ["mlp_out.1"], root / "f16", layout="token", dtype="float16",
                                   shard_size=3, progress=False),
        "f32-sequence": build_dataset(fp32, PROMPTS, ["resid_post.1", "pattern.0"], root / "f32",
                                      shard_size=3, progress=False),
    }


CASES = [("bf16-token", "resid_post.1"), ("bf16-token", "z.0"), ("f16-token", "mlp_out.1"),
         ("f32-sequence", "resid_post.1"), ("f32-sequence", "pattern.0"), ("f32-sequence", "tokens")]


def _ours(ds, column):
    """Our reader's tensor, as the float type other readers see (bf16 widened exactly)."""
    tensor = read_tensor(ds.to_arrow(), column)
    return tensor.float() if tensor.dtype == torch.bfloat16 else tensor


def _order(ds):
    """Rows sorted as SQL's ORDER BY prompt_index[, position] sorts them."""
    table = ds.to_arrow()
    keys = [table.column("prompt_index").to_pylist()]
    if "position" in table.schema.names:
        keys.append(table.column("position").to_pylist())
    return sorted(range(table.num_rows), key=lambda r: tuple(k[r] for k in keys))


def test_bf16_is_stored_exact_and_marked(datasets_built):
    ds = datasets_built["bf16-token"]
    stored = ds.tensor("z.0")
    assert stored.dtype == torch.bfloat16
    plain = torch.from_numpy(to_numpy(pq.read_table(ds.path).column("z.0")).copy())
    assert plain.dtype == torch.float32 and torch.equal(plain.to(torch.bfloat16).float(), plain)
    assert torch.equal(plain.to(torch.bfloat16).view(torch.int16), stored.view(torch.int16))


@pytest.mark.parametrize("name,column", CASES)
def test_pyarrow_reads_the_shapes(datasets_built, name, column):
    ds = datasets_built[name]
    table = pq.read_table(ds.path)
    want = _ours(ds, column)
    assert column_shape(table.schema, column) == tuple(want.shape[1:])
    field = table.schema.field(column)
    if column != "tokens":
        assert json.loads(field.metadata[b"interp_engine.shape"]) == list(want.shape[1:])
    assert torch.equal(torch.from_numpy(to_numpy(table.column(column))), want)


@pytest.mark.parametrize("name,column", CASES)
def test_pandas_reads_nested_arrays(datasets_built, name, column):
    import pandas as pd

    ds = datasets_built[name]
    frame = pd.read_parquet(ds.path)

    def stack(cell):
        return np.stack([stack(c) for c in cell]) if cell.dtype == object else cell

    got = torch.from_numpy(np.stack([stack(c) for c in frame[column]]))
    assert torch.equal(got, _ours(ds, column))


@pytest.mark.parametrize("name,column", CASES)
def test_duckdb_reads_fixed_size_arrays(datasets_built, name, column):
    duckdb = pytest.importorskip("duckdb")
    ds = datasets_built[name]
    order = "prompt_index, position" if name.endswith("token") else "prompt_index"
    rows = duckdb.sql(f"""SELECT "{column}" FROM read_parquet('{ds.path}/*.parquet') ORDER BY {order}""").fetchall()
    want = _ours(ds, column)[_order(ds)]
    got = torch.tensor([r[0] for r in rows], dtype=torch.float64)  # DuckDB widens float16 to FLOAT
    assert got.shape == want.shape and torch.equal(got.to(want.dtype), want)
    described = dict((r[0], r[1]) for r in duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{ds.path}/*.parquet')").fetchall())
    assert described[column].endswith("[]" * (want.dim() - 1)), described[column]  # docs/CLUSTER.md: lists, not FLOAT[4][64]


@pytest.mark.parametrize("name,column", CASES)
def test_hf_datasets_torch_format_gives_row_tensors(datasets_built, name, column, tmp_path, monkeypatch):
    hf = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds = datasets_built[name]
    loaded = hf.load_dataset("parquet", data_files=[str(f) for f in ds.files], split="train",
                             cache_dir=str(tmp_path / "hf"))
    got = loaded.with_format("torch")[:][column]
    want = _ours(ds, column)
    # HF's torch format widens floats to float32 and ints to int64 (exact for float16 / int32)
    want = want.to(torch.float32 if want.is_floating_point() else torch.int64)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)
