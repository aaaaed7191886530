"""positions= on the eager backend: a capture at some positions equals the full capture indexed
by hand at those positions (bit for bit: the forward is the same, the selection only drops rows),
padded batches keep per-row meaning (-1 = each row's own last token), the Cache says which
positions it holds, and bad selections are clear errors. Also Cache.select / Cache.to and
datasets built at a selection of positions."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import Cache, InputError, build_dataset, capture_generation, run_with_cache

from ..devices import load_kwargs

PROMPTS = ["The quick brown fox", "jumps", "over the lazy dog again"]
POINTS = ["resid_post", "z.1", "attn_out.2", "logits"]


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


def by_hand(full: Cache, address, rows: list[list[int]]) -> torch.Tensor:
    """The full capture at ``rows[b]`` positions of each row, zero-padded to the widest: an oracle
    that shares no code with the selection."""
    tensor = full[address]
    width = max(len(r) for r in rows)
    out = torch.zeros((tensor.shape[0], width, *tensor.shape[2:]), dtype=tensor.dtype, device=tensor.device)
    for b, r in enumerate(rows):
        for i, p in enumerate(r):
            out[b, i] = tensor[b, p]
    return out


@pytest.mark.parametrize("positions, rows", [
    (-1, lambda n: [n - 1]),
    ([0, -1], lambda n: sorted({0, n - 1})),
    (slice(-3, None), lambda n: list(range(max(0, n - 3), n))),
    (slice(1, None, 2), lambda n: list(range(1, n, 2))),
    ("prompt", lambda n: list(range(n))),
    (torch.tensor([2, 0]), lambda n: [0, 2]),
])
def test_padded_batch_selection_equals_full_capture_indexed(model, positions, rows):
    tokens = model.tok.to_tokens(PROMPTS)
    lengths = (tokens >= 0).sum(1).tolist()
    full = run_with_cache(model, tokens, POINTS)
    got = run_with_cache(model, tokens, POINTS, positions=positions)
    want_rows = [rows(n) for n in lengths]
    assert got.selected and list(got) == list(full)
    width = max(len(r) for r in want_rows)
    expected = torch.tensor([r + [-1] * (width - len(r)) for r in want_rows])
    assert torch.equal(got.positions, expected) and torch.equal(got.mask, expected >= 0)
    assert torch.equal(got.tokens, tokens)  # the whole input stays
    for address in full:
        assert torch.equal(got[address], by_hand(full, address, want_rows)), address
    assert torch.equal(full.select(positions)[POINTS[1]], got[POINTS[1]])


def test_last_token_of_each_row_and_pattern(model):
    tokens = model.tok.to_tokens(PROMPTS)
    full = run_with_cache(model, tokens, ["resid_post.2", "pattern.0", "q.1"])
    last = run_with_cache(model, tokens, ["resid_post.2", "pattern.0", "q.1"], positions=-1)
    for b, n in enumerate((tokens >= 0).sum(1).tolist()):
        assert torch.equal(last["resid_post.2"][b, 0], full["resid_post.2"][b, n - 1])
        assert torch.equal(last["q.1"][b, 0], full["q.1"][b, n - 1])
        # pattern [b, heads, q, k]: the query row is selected, every key kept
        assert torch.equal(last["pattern.0"][b, :, 0], full["pattern.0"][b, :, n - 1])
    assert last["pattern.0"].shape[-1] == tokens.shape[1]


def test_gradients_flow_through_a_selection(tiny_path):
    from interp_engine import load_model

    model = load_model(str(tiny_path("llama")), requires_grad=True, **load_kwargs())
    tokens = model.to_tokens("grad")
    embed = model.hf.model.embed_tokens.weight
    cache = run_with_cache(model, tokens, ["resid_post.1"], detach=False, positions=-1)
    cache["resid_post.1"].sum().backward()
    got, embed.grad = embed.grad.clone(), None
    # the same as the gradient of that position of the full capture, and it reaches every
    # prompt token (the last position attends to all of them)
    full = run_with_cache(model, tokens, ["resid_post.1"], detach=False)
    full["resid_post.1"][:, -1].sum().backward()
    torch.testing.assert_close(got, embed.grad, rtol=1e-5, atol=1e-7)
    assert bool((got[tokens[0]].abs().sum(-1) > 0).all())


def test_generation_positions(model):
    tokens = model.to_tokens("Once upon")
    n = tokens.shape[1]
    completion, full = capture_generation(model, tokens, ["resid_post.1", "logits"], max_tokens=6)
    total = full.tokens.shape[1]
    for positions, want in [("generated", list(range(n, total))), (-1, [n - 1]), ([0, -1], [0, n - 1]),
                            ("prompt", list(range(n)))]:
        again, cache = capture_generation(model, tokens, ["resid_post.1", "logits"], max_tokens=6,
                                          positions=positions)
        assert again == completion and torch.equal(cache.tokens, full.tokens)
        assert cache.positions.tolist() == [want], positions
        for address in full:
            assert torch.equal(cache[address], full[address][:, want]), (positions, address)


def test_async_capture_with_positions(model):
    prompts = [model.to_tokens(t) for t in ("one", "two words")]

    async def gather():
        return await asyncio.gather(*(model.capture(p, ["resid_post.0"], positions=-1) for p in prompts))

    for p, got in zip(prompts, asyncio.run(gather())):
        full = run_with_cache(model, p, ["resid_post.0"])
        assert torch.equal(got[next(iter(got))], full["resid_post.0"][:, -1:])


def test_bad_selections_are_clear_errors(model):
    tokens = model.tok.to_tokens(PROMPTS)  # row 1 ("jumps") is 6 tokens with its BOS
    with pytest.raises(InputError, match=r"position 8 is out of range for batch row 1, which has 6 tokens"):
        run_with_cache(model, tokens, POINTS, positions=8)
    with pytest.raises(InputError, match=r"position -7 is out of range for batch row 1"):
        run_with_cache(model, tokens, POINTS, positions=[-1, -7])
    with pytest.raises(InputError, match=r"positions=\[\] selects no position"):
        run_with_cache(model, tokens, POINTS, positions=[])
    with pytest.raises(InputError, match=r"selects no position of batch row 1 \(6 tokens\)"):
        run_with_cache(model, tokens, POINTS, positions=slice(10, None))
    with pytest.raises(InputError, match="only applies to capture_generation"):
        run_with_cache(model, tokens, POINTS, positions="generated")
    with pytest.raises(InputError, match="max_tokens=1 selects nothing"):
        capture_generation(model, tokens[:1], POINTS, max_tokens=1, positions="generated")
    with pytest.raises(InputError, match="unknown positions='last'; positions may be None"):
        run_with_cache(model, tokens, POINTS, positions="last")
    with pytest.raises(InputError, match="must be ints, got 1.5"):
        run_with_cache(model, tokens, POINTS, positions=[0, 1.5])
    with pytest.raises(InputError, match="slice step cannot be zero"):
        run_with_cache(model, tokens, POINTS, positions=slice(0, None, 0))
    # the model keeps serving
    assert run_with_cache(model, tokens, ["resid_post.0"], positions=-1)["resid_post.0"].shape[1] == 1


def test_cache_select_to_and_save(model, tmp_path):
    tokens = model.tok.to_tokens(PROMPTS)
    full = run_with_cache(model, tokens, ["resid_post.1", "pattern.1"])
    assert not full.selected and torch.equal(full.positions[2], torch.arange(tokens.shape[1]))
    assert full.positions[1].tolist()[-1] == -1
    two = full.select([0, -1])
    lengths = (tokens >= 0).sum(1)
    assert two.positions.tolist() == [[0, int(n) - 1] for n in lengths]
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(two["resid_post.1"][b], full["resid_post.1"][b, [0, n - 1]])
        assert torch.equal(two["pattern.1"][b], full["pattern.1"][b][:, [0, n - 1]])
    last = two.select(-1)  # a selection of a selection
    assert torch.equal(last["resid_post.1"], two["resid_post.1"][:, 1:])
    with pytest.raises(KeyError, match=r"positions \[1\] of row 0 are not held"):
        two.select(1)
    moved = two.to("meta")
    assert moved["resid_post.1"].device.type == "meta" and torch.equal(moved.positions, two.positions)
    assert two.to(dtype=torch.float64)["resid_post.1"].dtype == torch.float64
    two.save(tmp_path / "c.safetensors")
    back = Cache.load(tmp_path / "c.safetensors")
    assert back.selected and torch.equal(back.positions, two.positions)
    assert torch.equal(back["resid_post.1"], two["resid_post.1"].cpu())  # a loaded cache is on the CPU


def test_dataset_of_last_tokens(model, tmp_path):
    import pyarrow.parquet as pq

    from interp_engine.dataset.shard import read_tensor

    prompts = [f"prompt {i} " + "ab" * i for i in range(7)]
    token = build_dataset(model, prompts, ["resid_post.1"], tmp_path / "t", layout="token", positions=-1,
                          shard_size=3, progress=False)
    seq = build_dataset(model, prompts, ["resid_post.1"], tmp_path / "s", positions=[0, -1], shard_size=3,
                        progress=False)
    assert token.rows == 7 and seq.rows == 7
    assert token.manifest["identity"]["positions"] == -1 and seq.manifest["identity"]["positions"] == [0, -1]
    t_table, s_table = pq.read_table(tmp_path / "t"), pq.read_table(tmp_path / "s")
    order_t = torch.argsort(torch.tensor(t_table.column("prompt_index").to_pylist()))
    order_s = torch.argsort(torch.tensor(s_table.column("prompt_index").to_pylist()))
    last = read_tensor(t_table, "resid_post.1")[order_t]
    ends = read_tensor(s_table, "resid_post.1")[order_s]
    assert ends.shape == (7, 2, model.d_model)
    for i, prompt in enumerate(prompts):
        first = i - i % 3  # the shard's own padded batch: the same computation as the build's
        batch = run_with_cache(model, model.tok.to_tokens(prompts[first : first + 3]), ["resid_post.1"])
        n = int(batch.lengths[i - first])
        full = batch["resid_post.1"][i - first, :n].cpu()  # a dataset is read back on the CPU
        assert t_table.column("position").to_pylist()[int(order_t[i])] == n - 1
        assert torch.equal(last[i], full[-1]) and torch.equal(ends[i], full[[0, n - 1]])
    with pytest.raises(InputError, match="out of range"):
        build_dataset(model, ["a", "bcdefgh"], ["resid_post.1"], tmp_path / "bad", positions=5, progress=False)
    assert not (tmp_path / "bad").exists()
