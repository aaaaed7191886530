"""Training from a dataset: the SAELens export (loaded with ``datasets.load_from_disk``, checked
against the Parquet dataset) and the streaming torch loader (every row once, shuffled across
sequences, split by rank, flat memory on a dataset 10x its memory cap)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from interp_engine import InputError, build_dataset, export_saelens, load_model
from interp_engine.dataset.shard import read_tensor

PROMPTS = [f"Line {i}: " + "one two three four " * (1 + i % 5) for i in range(20)]


@pytest.fixture(scope="module")
def built(tiny_path, eager_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    bf16 = load_model(str(tiny_path("llama")), dtype="bfloat16")
    return {
        "token": build_dataset(bf16, PROMPTS, ["resid_post.2", "z.1", "logits"], root / "tok", layout="token",
                               shard_size=6, progress=False),
        "sequence": build_dataset(eager_models("llama"), PROMPTS, ["mlp_out.0"], root / "seq", shard_size=6,
                                  progress=False),
    }


def _stream(ds, point):
    """Our reader's real-token rows and token ids, in stored order."""
    table = ds.to_arrow()
    rows = read_tensor(table, point)
    if ds.manifest["identity"]["layout"] == "token":
        return rows, read_tensor(table, "token")
    mask = torch.arange(rows.shape[1])[None, :] < torch.tensor(table.column("length").to_pylist())[:, None]
    return rows[mask], read_tensor(table, "tokens")[mask]


@pytest.mark.parametrize("layout,point,hook", [("token", "resid_post.2", "blocks.2.hook_resid_post"),
                                               ("token", "z.1", "blocks.1.attn.hook_z"),
                                               ("sequence", "mlp_out.0", "blocks.0.mlp.hook_out")])
def test_saelens_export_loads_with_load_from_disk(built, layout, point, hook, tmp_path):
    import datasets as hf

    ds, context = built[layout], 16
    out = ds.export_saelens(tmp_path / "sae", point, context)
    loaded = hf.load_from_disk(str(out))
    assert isinstance(loaded, hf.Dataset) and loaded.column_names == [hook, "token_ids"]
    rows, ids = _stream(ds, point)
    d_in = int(np.prod(rows.shape[1:]))
    feature = loaded.features[hook]
    assert isinstance(feature, hf.Array2D) and feature.shape == (context, d_in) and feature.dtype == "float32"
    assert loaded.features["token_ids"].length == context
    n = len(rows) // context
    assert len(loaded) == n
    # what SAELens does: set_format("torch") on [hook, token_ids], slice, reshape
    loaded.set_format(type="torch", columns=[hook, "token_ids"])
    acts = loaded[0:n][hook]
    assert acts.shape == (n, context, d_in)
    assert torch.equal(acts.reshape(n * context, d_in), rows[: n * context].float().reshape(n * context, d_in))
    assert torch.equal(loaded[0:n]["token_ids"].reshape(-1), ids[: n * context].long())


def test_saelens_export_refuses_points_without_a_hook_name(built, tmp_path):
    with pytest.raises(InputError, match="'logits' has no TransformerLens hook name.*resid_post.L"):
        export_saelens(built["token"], tmp_path / "x", "logits", 8)
    with pytest.raises(InputError, match="not in this dataset"):
        built["token"].export_saelens(tmp_path / "x", "resid_post.0", 8)
    assert not (tmp_path / "x").exists()


def test_loader_yields_every_row_once_shuffled_across_sequences(built):
    ds = built["token"]
    rows, _ = _stream(ds, "resid_post.2")
    loader = ds.loader("resid_post.2", 32, shuffle=True, seed=3, shuffle_buffer=1024)  # more than a shard
    batches = list(loader)
    assert all(b.shape == (32, rows.shape[1]) for b in batches[:-1]) and batches[0].dtype == torch.bfloat16
    got = torch.cat(batches)
    assert got.shape == rows.shape
    assert np.array_equal(np.unique(got.float().numpy(), axis=0), np.unique(rows.float().numpy(), axis=0))
    assert not torch.equal(got, rows)  # shuffled
    assert torch.equal(torch.cat(list(ds.loader("resid_post.2", 32, shuffle=True, seed=3, shuffle_buffer=1024))), got)
    assert torch.equal(torch.cat(list(ds.loader("resid_post.2", 32, shuffle=False))), rows)
    # a batch mixes tokens of several prompts: look each row up in the stream
    index = {tuple(r.float().tolist()): p for r, p in zip(rows, ds.to_arrow().column("prompt_index").to_pylist())}
    assert len({index[tuple(r.float().tolist())] for r in batches[0]}) >= 4


def test_loader_splits_shards_by_rank_and_casts(built):
    ds = built["sequence"]
    rows, _ = _stream(ds, "mlp_out.0")
    parts = [torch.cat(list(ds.loader("mlp_out.0", 16, shuffle=True, seed=1, rank=r, world_size=2,
                                      dtype="float16"))) for r in range(2)]
    assert parts[0].dtype == torch.float16 and len(parts[0]) + len(parts[1]) == len(rows)
    together = torch.cat(parts).float().numpy()
    assert np.array_equal(np.unique(together, axis=0), np.unique(rows.half().float().numpy(), axis=0))
    with pytest.raises(InputError, match="not in this dataset"):
        ds.loader("resid_post.9", 8)
    with pytest.raises(InputError, match="rank must be in"):
        ds.loader("mlp_out.0", 8, rank=2, world_size=2)
    batches = list(torch.utils.data.DataLoader(ds.loader("mlp_out.0", 16, shuffle=False), batch_size=None,
                                               num_workers=0))
    assert torch.equal(torch.cat(batches), rows)


_CHILD = r"""
import ctypes, json, sys, psutil, torch
from interp_engine import ActivationDataset
ds = ActivationDataset.open(sys.argv[1])
proc = psutil.Process()
libc = ctypes.CDLL("libc.so.6")


def rss():
    libc.malloc_trim(0)  # hand freed arenas back first, so RSS counts what is held, not the allocator's slack
    return proc.memory_info().rss


loader = ds.loader("mlp_post.1", 256, shuffle=True, seed=0, shuffle_buffer=4096)
rows, peak, warm = 0, 0, None
for i, batch in enumerate(loader):
    rows += len(batch)
    if i == 60:  # past the first passes of the buffer and the readers' lazy set-up (~10 % of the rows)
        warm = rss()
    if warm is not None and i % 8 == 0:
        peak = max(peak, rss())
print(json.dumps({"rows": rows, "warm": warm, "peak": peak}))
"""


def test_loader_memory_is_flat_on_a_dataset_ten_times_its_cap(eager_models, tmp_path):
    # bytes of RSS growth allowed while streaming (RSS read after malloc_trim; the untrimmed allocator's
    # noise was 7-24 MiB),
    # a loader that held what it read would grow by the whole column
    cap = 24 << 20
    prompts = [f"{i:04d} " + "abcdefghij" * 20 for i in range(1200)]
    ds = build_dataset(eager_models("llama"), prompts, ["mlp_post.1"], tmp_path / "big", layout="token",
                       shard_size=16, progress=False)
    column_bytes = ds.rows * 256 * 4
    assert column_bytes >= 10 * cap, column_bytes
    done = subprocess.run([sys.executable, "-c", _CHILD, str(ds.path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["rows"] == ds.rows
    growth = stats["peak"] - stats["warm"]
    assert growth < cap, f"RSS grew {growth / 2**20:.1f} MiB while streaming {column_bytes / 2**20:.0f} MiB"
