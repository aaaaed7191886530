"""Feature points in activation datasets: a dictionary's features stored sparse (ids and values of
the active ones per token), read back equal to the capture of the same batch, by our reader,
pandas and DuckDB; subsets and the error term stored dense; a resume with other weights refused."""

from __future__ import annotations

import pytest
import torch

from interp_engine import build_dataset, run_with_cache
from interp_engine.dataset.shard import read_tensor
from interp_engine.errors import AddressError, DatasetExistsError

from .. import sparse_dicts as sd

PROMPTS = [f"Prompt {i}: " + "more words " * (i % 4) + "end" for i in range(7)]
POINTS = ["resid_post.1", "resid_post.1.features", "resid_post.1.features[3,9]", "resid_post.1.sae_error"]


def shard_caches(model, sae, shard_size):
    """The capture of each shard's padded batch (what the build runs, one batch per shard)."""
    for first in range(0, len(PROMPTS), shard_size):
        texts = PROMPTS[first:first + shard_size]
        yield first, texts, run_with_cache(model, model.tok.to_tokens(texts), POINTS, saes=sae)


def test_sequence_layout_stores_the_active_features_of_each_position(llama, tmp_path):
    sae = sd.sae(k=8)
    ds = build_dataset(llama, PROMPTS, POINTS, tmp_path / "seq", shard_size=3, progress=False, saes=sae)
    assert ds.manifest["identity"]["saes"][0]["key"] == sae.key
    table = ds.to_arrow()
    assert "resid_post.1.features" not in table.column_names
    dense = ds.tensor("resid_post.1.features")
    assert dense.shape == (len(PROMPTS), ds.manifest["identity"]["max_length"], sd.D_SAE)
    for first, texts, cache in shard_caches(llama, sae, 3):
        rows, n = slice(first, first + len(texts)), cache.tokens.shape[1]
        assert torch.equal(dense[rows, :n], cache["resid_post.1.features"])
        assert not dense[rows, n:].any()
        assert torch.equal(read_tensor(table, "resid_post.1.features[3,9]")[rows, :n],
                           cache["resid_post.1.features[3,9]"])
        assert torch.equal(read_tensor(table, "resid_post.1.sae_error")[rows, :n], cache["resid_post.1.sae_error"])
    ids = table.column("resid_post.1.features.ids").to_pylist()
    assert all(len(ids[0][p]) <= 8 for p in range(len(ids[0])))  # TopK: at most k per token, padding empty


def test_token_layout_is_readable_by_pandas_and_duckdb(llama, tmp_path):
    import duckdb

    sae = sd.sae(jumprelu=True)
    ds = build_dataset(llama, PROMPTS, POINTS, tmp_path / "tok", layout="token", shard_size=4, progress=False,
                       saes=[sae])
    frame = ds.to_pandas()
    sparse = ds.sparse("resid_post.1.features")
    assert sparse.n == ds.rows == len(frame)
    for first, texts, cache in shard_caches(llama, sae, 4):
        mask = cache.mask
        want = cache["resid_post.1.features"][mask]  # the shard's real tokens in order
        rows = slice(sum(len(llama.tok.encode(t)) for t in PROMPTS[:first]), None)
        got = sparse.dense()[rows][: want.shape[0]]
        assert torch.equal(got, want)
        counts = frame["resid_post.1.features.ids"].map(len).to_numpy()[rows][: want.shape[0]]
        assert counts.tolist() == (want != 0).sum(-1).tolist()
    files = [str(f) for f in ds.files]
    nnz, tokens = duckdb.sql(f"""SELECT sum(len("resid_post.1.features.ids")), count(*)
                                 FROM read_parquet({files})""").fetchall()[0]
    assert tokens == ds.rows and nnz == int(sparse.offsets[-1])
    top = duckdb.sql(f"""SELECT fid, count(*) AS n FROM (SELECT unnest("resid_post.1.features.ids") AS fid
                         FROM read_parquet({files})) GROUP BY fid ORDER BY n DESC, fid LIMIT 1""").fetchall()[0]
    fired = (sparse.dense() != 0).sum(0)
    assert top == (int(fired.argmax()), int(fired.max()))


def test_a_resume_with_another_dictionary_is_refused(llama, tmp_path):
    build_dataset(llama, PROMPTS, ["resid_post.1.features"], tmp_path / "r", progress=False, saes=sd.sae(seed=0))
    with pytest.raises(DatasetExistsError):
        build_dataset(llama, PROMPTS, ["resid_post.1.features"], tmp_path / "r", progress=False, saes=sd.sae(seed=5))
    with pytest.raises(AddressError, match="needs a dictionary that reads resid_post.1"):
        build_dataset(llama, PROMPTS, ["resid_post.1.features"], tmp_path / "none", progress=False)
