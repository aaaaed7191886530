"""Activation datasets built with a local model: layouts, dtypes, prompt sources, manifest,
resume and refusal. (The same builds through a cluster are in test_cluster.py.)"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from interp_engine import InputError, build_dataset, load_model, run_with_cache
from interp_engine.dataset.manifest import MANIFEST
from interp_engine.errors import DatasetExistsError, PromptsError
from interp_engine.dataset.shard import read_tensor

PROMPTS = [f"Example {i}: " + "spam " * (i % 6) + "eggs" for i in range(11)]


def test_sequence_layout_rows_are_the_padded_capture(llama, tmp_path):
    ds = build_dataset(llama, PROMPTS, ["resid_post.1", "z.2", "pattern.0"], tmp_path / "d", shard_size=4,
                       progress=False)
    assert (ds.rows, ds.shards, ds.prompts) == (11, 3, 11)
    assert [f.name for f in ds.files] == [f"part-{i:05d}-of-00003.parquet" for i in range(3)]
    table = ds.to_arrow()
    width = ds.manifest["identity"]["max_length"]
    for shard in range(3):  # a shard is exactly the local batch of its prompts, padded to width
        rows = slice(shard * 4, min(11, shard * 4 + 4))
        tokens = llama.tok.to_tokens(PROMPTS[rows])
        cache = run_with_cache(llama, tokens, ["resid_post.1", "z.2", "pattern.0"])
        n = tokens.shape[1]
        assert torch.equal(read_tensor(table, "tokens")[rows][:, :n], tokens.int())
        assert torch.equal(read_tensor(table, "resid_post.1")[rows][:, :n], cache["resid_post.1"])
        assert torch.equal(read_tensor(table, "z.2")[rows][:, :n], cache["z.2"])
        assert torch.equal(read_tensor(table, "pattern.0")[rows][:, :, :n, :n], cache["pattern.0"])
        assert not read_tensor(table, "resid_post.1")[rows][:, n:].any()
        assert read_tensor(table, "tokens").shape[1] == width


def test_token_layout_has_a_row_per_real_position(llama, tmp_path):
    ds = build_dataset(llama, PROMPTS, ["mlp_out.0", "logits"], tmp_path / "t", layout="token", shard_size=5,
                       progress=False)
    lengths = [len(llama.tok.encode(p)) for p in PROMPTS]
    assert ds.rows == sum(lengths) == ds.tokens
    table = ds.to_arrow()
    mlp = read_tensor(table, "mlp_out.0")
    index = table.column("prompt_index").to_pylist()
    position = table.column("position").to_pylist()
    for i in (0, 7):
        cache = run_with_cache(llama, llama.to_tokens(PROMPTS[i]), ["mlp_out.0"])
        rows = [r for r, p in enumerate(index) if p == i]
        assert [position[r] for r in rows] == list(range(lengths[i]))
        torch.testing.assert_close(mlp[rows], cache["mlp_out.0"][0], rtol=1e-5, atol=1e-6)


def test_bf16_model_is_stored_bit_for_bit(tiny_path, tmp_path):
    model = load_model(str(tiny_path("llama")), dtype="bfloat16")
    ds = build_dataset(model, PROMPTS[:3], ["resid_post.1"], tmp_path / "b", layout="token", progress=False)
    assert ds.manifest["identity"]["dtype"] == "bfloat16"
    field = pq.read_schema(ds.files[0]).field("resid_post.1")  # exact float32 values, marked bf16
    assert field.type.value_type == pa.float32() and field.metadata[b"interp_engine.dtype"] == b"bfloat16"
    stored = ds.tensor("resid_post.1")
    tokens = model.tok.to_tokens(PROMPTS[:3])
    cache = run_with_cache(model, tokens, ["resid_post.1"])
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored.view(torch.int16), cache["resid_post.1"][tokens >= 0].view(torch.int16))


def test_prompt_sources_give_the_same_dataset(llama, tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": PROMPTS, "other": list(range(len(PROMPTS)))}), parquet)
    built = [build_dataset(llama, source, ["resid_post.0"], tmp_path / f"s{i}", shard_size=3, progress=False)
             for i, source in enumerate([PROMPTS, jsonl, parquet])]
    for other in built[1:]:
        assert other.manifest["identity"] == built[0].manifest["identity"]
        assert other.to_arrow().equals(built[0].to_arrow())


def test_manifest_records_provenance(llama, tmp_path):
    ds = build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "m", progress=False)
    manifest = json.loads((tmp_path / "m" / MANIFEST).read_text())
    identity = manifest["identity"]
    for key in ("model", "weights_sha256", "backend", "model_dtype", "dtype", "points", "tokenizer_sha256",
                "package_version", "prompts_sha256", "layout", "n_prompts"):
        assert identity[key] not in (None, ""), key
    assert manifest["status"] == "complete" and manifest["result"]["rows"] == ds.rows == 11
    assert json.loads(pq.read_schema(ds.files[0]).metadata[b"interp_engine.manifest"]) == identity


def test_tokenizer_fingerprint_is_kept_until_the_tokenizer_changes(llama):
    import copy

    from interp_engine.dataset.manifest import tokenizer_fingerprint

    first = tokenizer_fingerprint(llama.tok.hf)
    twin = copy.deepcopy(llama.tok.hf)  # a different object: computed afresh, same content
    assert tokenizer_fingerprint(twin) == first == tokenizer_fingerprint(llama.tok.hf)
    twin.add_tokens(["<probe_token>"])
    grown = tokenizer_fingerprint(twin)
    assert grown != first and tokenizer_fingerprint(copy.deepcopy(twin)) == grown
    assert tokenizer_fingerprint(llama.tok.hf) == first


def test_rerun_resumes_and_ends_identical(llama, tmp_path):
    out = tmp_path / "r"
    first = build_dataset(llama, PROMPTS, ["resid_post.1"], out, shard_size=2, progress=False)
    before = {f.name: f.read_bytes() for f in first.files}
    first.files[3].unlink()
    (out / ".part-00001-of-00006.parquet.tmp-0123456789ab").write_bytes(b"half a file")
    again = build_dataset(llama, PROMPTS, ["resid_post.1"], out, shard_size=2, progress=False)
    assert again.resumed_shards == 5 and again.rows == 11
    assert {f.name: f.read_bytes() for f in again.files} == before
    assert not list(out.glob(".*tmp*"))


def test_bad_arguments_fail_before_any_work(llama, tmp_path):
    with pytest.raises(InputError, match="unknown layout"):
        build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "x", layout="rows")
    with pytest.raises(InputError, match="no per-token row"):
        build_dataset(llama, PROMPTS, ["pattern.0"], tmp_path / "x", layout="token")
    with pytest.raises(InputError, match="shard_size"):
        build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "x", shard_size=0)
    with pytest.raises(InputError, match="unknown dtype"):
        build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "x", dtype="int8")
    with pytest.raises(PromptsError, match="prompt 1 .* empty"):
        build_dataset(llama, ["ok", ""], ["resid_post.1"], tmp_path / "x")
    with pytest.raises(PromptsError, match="longer than the model's"):
        build_dataset(llama, ["x" * 300], ["resid_post.1"], tmp_path / "x")
    assert not (tmp_path / "x").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DatasetExistsError, match="not a dataset this engine wrote"):
        build_dataset(llama, PROMPTS, ["resid_post.1"], foreign, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_shuffled_build_mixes_prompts_and_is_reproducible(llama, tmp_path):
    plain = build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "plain", layout="token", shard_size=4,
                          progress=False)
    mixed = build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "mixed", layout="token", shard_size=4,
                          shuffle=True, seed=7, progress=False)
    a, b = plain.to_arrow(), mixed.to_arrow()
    assert mixed.rows == plain.rows and mixed.manifest["identity"]["shuffle_seed"] == 7

    def keyed(table):
        rows = read_tensor(table, "resid_post.1")
        return {(p, q): rows[r] for r, (p, q) in enumerate(zip(table.column("prompt_index").to_pylist(),
                                                                table.column("position").to_pylist()))}

    want, got = keyed(a), keyed(b)
    assert got.keys() == want.keys()  # every token once
    for key, row in want.items():  # each prompt is still captured in a batch of shard_size prompts
        torch.testing.assert_close(got[key], row, rtol=1e-5, atol=1e-5)
    first = mixed.to_arrow().slice(0, 20).column("prompt_index").to_pylist()
    assert len(set(first)) >= 3 and first != sorted(first)  # neighbours come from different prompts
    shard0 = pq.read_table(mixed.files[0]).column("prompt_index").to_pylist()
    assert set(shard0) != {0, 1, 2, 3}  # shard 0 holds a random set of prompts
    again = build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "again", layout="token", shard_size=4,
                          shuffle=True, seed=7, progress=False)
    assert [f.read_bytes() for f in again.files] == [f.read_bytes() for f in mixed.files]
    mixed.files[1].unlink()  # a resume rewrites the same shard
    resumed = build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "mixed", layout="token", shard_size=4,
                            shuffle=True, seed=7, progress=False)
    assert resumed.resumed_shards == 2 and [f.read_bytes() for f in resumed.files] == \
        [f.read_bytes() for f in again.files]
    with pytest.raises(InputError, match="seed must be"):
        build_dataset(llama, PROMPTS, ["resid_post.1"], tmp_path / "x", shuffle=True, seed=-1)
