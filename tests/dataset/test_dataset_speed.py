"""Dataset builds at the model's own speed (issue 23): eager shards in padded batches of similar
lengths, writes beside the next capture, and the same files as a shard captured the plain way
(eager: the whole shard as one padded batch; vLLM: one prompt at a time).
"""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from interp_engine import InputError, build_dataset, run_with_cache
from interp_engine.batching import plan_batches
from ..oracles import REL, assert_near
from interp_engine.dataset.integrity import identity_json
from interp_engine.dataset.shard import Captured, ShardSpec, read_tensor, shard_bytes, shard_table
from interp_engine.tokens import pad_batch

PROMPTS = [f"Prompt {i}: " + "lorem ipsum " * (i % 7) for i in range(23)]
POINTS = ["resid_post.1", "z.2"]


def _sha(ds) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in ds.files}


def _reference(model, ds, capture) -> dict[str, str]:
    """Each shard's sha256 as the build before issue 23 made it: ``capture(tokens)`` gives the
    cache of the shard's padded batch, then the same table and Parquet encoding."""
    identity = ds.manifest["identity"]
    size = identity["shard_size"]
    spec = ShardSpec(None, tuple(identity["points"]), identity["layout"], identity["dtype"], identity["max_length"],
                     ds.shards, size, identity_json(identity))
    out = {}
    for i, f in enumerate(ds.files):
        texts = PROMPTS[i * size:(i + 1) * size]
        tokens = pad_batch([model.tok.encode(t) for t in texts])
        table, _ = shard_table(spec, Captured(i, tokens, capture(tokens), torch.arange(i * size, i * size + len(texts))))
        out[f.name] = hashlib.sha256(shard_bytes(table)).hexdigest()
    return out


def test_plan_batches_cuts_by_padded_tokens_and_keeps_each_row_once():
    lengths = [5, 40, 7, 39, 6, 41, 100, 8]
    plan = plan_batches(lengths, 96)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert batch == sorted(batch)  # the rows' own order inside a batch
        assert len(batch) * max(lengths[i] for i in batch) <= 96 or len(batch) == 1
    assert [6] in plan  # longer than the budget: a batch of its own
    assert {frozenset(b) for b in plan} >= {frozenset({0, 2, 4, 7})}  # the short rows together
    assert plan_batches(lengths, 10_000) == [list(range(len(lengths)))]  # all fit: the batch as given
    assert plan_batches([], 10) == []


def test_default_build_is_the_shard_as_one_padded_batch_byte_for_byte(llama, tmp_path):
    ds = build_dataset(llama, PROMPTS, POINTS, tmp_path / "d", shard_size=5, progress=False)
    assert _sha(ds) == _reference(llama, ds, lambda tokens: run_with_cache(llama, tokens, POINTS))
    assert {name: rec["sha256"] for name, rec in ds.manifest["shards"].items()} == _sha(ds)


def test_small_batches_keep_order_names_and_values_and_rebuild_identically(llama, tmp_path):
    whole = build_dataset(llama, PROMPTS, POINTS, tmp_path / "whole", shard_size=8, progress=False)
    cut = build_dataset(llama, PROMPTS, POINTS, tmp_path / "cut", shard_size=8, progress=False, batch_tokens=40)
    assert [f.name for f in cut.files] == [f.name for f in whole.files]
    a, b = whole.to_arrow(), cut.to_arrow()
    for column in ("prompt_index", "length", "tokens"):
        assert a.column(column).equals(b.column(column))
    for point in POINTS:  # other batches: the same values within float rounding
        assert_near(read_tensor(b, point), read_tensor(a, point), point, 1e-5)
    again = build_dataset(llama, PROMPTS, POINTS, tmp_path / "again", shard_size=8, progress=False, batch_tokens=40,
                          writers=3)
    assert _sha(again) == _sha(cut)  # the batches are a function of the shard: same bits, any writers
    cut.files[1].unlink()
    resumed = build_dataset(llama, PROMPTS, POINTS, tmp_path / "cut", shard_size=8, progress=False, batch_tokens=40)
    assert resumed.resumed_shards == 2 and _sha(resumed) == _sha(again)


def test_token_layout_with_positions_in_small_batches(llama, tmp_path):
    kw = dict(layout="token", positions=[0, -1], shard_size=6, progress=False)
    whole = build_dataset(llama, PROMPTS, ["resid_post.2"], tmp_path / "w", **kw)
    cut = build_dataset(llama, PROMPTS, ["resid_post.2"], tmp_path / "c", batch_tokens=30, **kw)
    a, b = whole.to_arrow(), cut.to_arrow()
    assert a.column("prompt_index").equals(b.column("prompt_index")) and a.column("position").equals(b.column("position"))
    assert_near(read_tensor(b, "resid_post.2"), read_tensor(a, "resid_post.2"), "resid_post.2", 1e-5)


def test_the_next_shard_is_captured_while_one_is_written(llama, tmp_path, monkeypatch):
    """Shard 0's write waits until shard 1 has been captured: a build that wrote in series with
    the capture would never get there (the wait gives up after 60 s and the test fails)."""
    import interp_engine.dataset.writer as writer
    from interp_engine.dataset.store import Store

    captured_1 = threading.Event()
    real_capture = writer.capture_shard

    def capture(model, spec, index, texts):
        out = real_capture(model, spec, index, texts)
        if index == 1:
            captured_1.set()
        return out

    seen = []
    real_write = Store.write

    def write(self, name, data, **options):
        if name.startswith("part-00000"):
            seen.append(captured_1.wait(60))
        real_write(self, name, data, **options)

    monkeypatch.setattr(writer, "capture_shard", capture)
    monkeypatch.setattr(Store, "write", write)
    ds = build_dataset(llama, PROMPTS, POINTS, tmp_path / "o", shard_size=4, progress=False)
    assert seen == [True] and ds.shards == 6


def test_bounded_in_flight_and_errors(llama, tmp_path, monkeypatch):
    import interp_engine.dataset.writer as writer

    running, most = [0], [0]
    lock = threading.Lock()
    real = writer.write_captured

    def counted(spec, captured):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            if captured.index == 3:
                raise OSError("the disk is full")
            return real(spec, captured)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(writer, "write_captured", counted)
    with pytest.raises(OSError, match="disk is full"):
        build_dataset(llama, PROMPTS, POINTS, tmp_path / "e", shard_size=2, progress=False, writers=2)
    assert 1 <= most[0] <= 2
    monkeypatch.undo()
    resumed = build_dataset(llama, PROMPTS, POINTS, tmp_path / "e", shard_size=2, progress=False, writers=2)
    assert resumed.rows == len(PROMPTS)
    for bad in (0, 17, True, "2"):
        with pytest.raises(InputError, match="writers must be"):
            build_dataset(llama, PROMPTS, POINTS, tmp_path / "x", writers=bad)
    with pytest.raises(InputError, match="batch_tokens must be"):
        build_dataset(llama, PROMPTS, POINTS, tmp_path / "x", batch_tokens=0)


# -- vLLM: every prompt of a shard in flight, and only the layers a prefill reads ---------------
@pytest.fixture(scope="module")
def vllm_llama(tiny_path):
    pytest.importorskip("vllm")
    from interp_engine import load_model

    with load_model(str(tiny_path("llama")), backend="vllm", max_model_len=128) as model:
        yield model


def _state(model) -> dict:
    from interp_engine.backends.vllm.loop import run_on_loop

    return run_on_loop(model._loop, "interp_state")[0]


def test_vllm_build_batches_the_engine_and_runs_only_the_layers_it_reads(vllm_llama, llama, tmp_path):
    """A build of ``resid_post.0`` (1 of 3 layers) keeps a shard's prompts in flight together and
    runs the engine shortened; its files equal shards captured one prompt at a time through the
    whole model (``logits`` asked too), bit for bit wherever the engine computes a prompt in a
    batch as it does alone (checked here first), else within the tolerance."""
    from interp_engine.batching import join_rows
    from interp_engine.cache import Cache

    model = vllm_llama
    assert model.shortens
    rows = [torch.tensor([model.tok.encode(t)]) for t in PROMPTS]
    full = ["resid_post.0", "logits"]
    alone = [model.run_with_cache(row, full) for row in rows]
    together = model.run_many(rows, full)
    invariant = all(torch.equal(a[p], b[p]) for a, b in zip(alone, together) for p in full)
    assert max(_state(model)["max_batch"], 1) > 1  # run_many put prompts in one forward
    before = model._loop.shortened_steps
    ds = build_dataset(model, PROMPTS, ["resid_post.0"], tmp_path / "v", shard_size=5, progress=False)
    assert model._loop.shortened_steps > before
    assert _state(model)["layers_run"] == model.n_layers  # an idle engine is whole again

    def one_at_a_time(tokens):
        parts = [model.run_with_cache(row, full) for row in (r[r >= 0][None] for r in tokens)]
        joined, padded, _ = join_rows([{a: c[a] for a in c if str(a) == "resid_post.0"} for c in parts],
                                      [c.tokens for c in parts], tokens.shape[1])
        return Cache(joined, padded, None, model.name, model.backend)

    want = _reference(model, ds, one_at_a_time)
    if invariant:
        assert _sha(ds) == want
    reference = build_dataset(model, PROMPTS, ["resid_post.0", "logits"], tmp_path / "full", shard_size=5,
                              progress=False)
    got = read_tensor(ds.to_arrow(), "resid_post.0")
    assert_near(got, read_tensor(reference.to_arrow(), "resid_post.0"), "resid_post.0", 1e-5)
    # whatever the batching: an oracle outside the engine, the eager backend on the same weights
    eager = build_dataset(llama, PROMPTS, ["resid_post.0"], tmp_path / "eager", shard_size=5, progress=False)
    assert_near(got, read_tensor(eager.to_arrow(), "resid_post.0"), "resid_post.0 against eager", REL)


def test_vllm_logits_and_generation_never_run_shortened(vllm_llama):
    """Generation and logits requests in flight beside shortened prefills: the engine runs
    whole while they are there, so their logits and tokens are the ones they get alone."""
    import asyncio

    model = vllm_llama
    rows = [torch.tensor([model.tok.encode(t)]) for t in PROMPTS]
    logits_alone = model.run_with_cache(rows[3], ["logits"])["logits"]
    completion_alone, _ = model.capture_generation(rows[5], ["resid_post.2"], max_tokens=6)

    async def mixed():
        short = [model.capture(row, ["resid_post.0"]) for row in rows]
        return await asyncio.gather(model.capture(rows[3], ["logits"]),
                                    model.capture_generation_async(rows[5], ["resid_post.2"], max_tokens=6), *short)

    logits, (completion, _), *_ = asyncio.run(mixed())
    assert_near(logits[list(logits)[0]], logits_alone, "logits", 1e-5)
    assert completion.token_ids == completion_alone.token_ids
    assert _state(model)["layers_run"] == model.n_layers
