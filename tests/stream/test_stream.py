"""activation_stream on a local model: an epoch yields exactly a dataset build's rows, shuffled
through a bounded buffer, deterministic from its seed, and resumable from ``state()``."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from interp_engine import InputError, activation_stream

from .rows import as_rows, built_rows, joined, same_multiset

PROMPTS = [f"the quick brown fox {i} jumps over the lazy dog " * (1 + i % 4) for i in range(23)]
POINTS = ["resid_post.1", "mlp_out.0"]
SETTINGS = dict(batch_tokens=32, shuffle_buffer=96, shard_size=4, seed=5, progress=False)


@pytest.fixture(scope="module")
def built(llama, tmp_path_factory):
    return as_rows(built_rows(llama, PROMPTS, POINTS, tmp_path_factory.mktemp("ds") / "d", shard_size=4), POINTS)


def test_epoch_is_the_dataset_rows(llama, built):
    stream = activation_stream(llama, PROMPTS, POINTS, **SETTINGS)
    batches = list(stream)
    assert all(set(b) == set(POINTS) for b in batches)
    assert [len(b[POINTS[0]]) for b in batches[:-1]] == [32] * (len(batches) - 1)
    assert len(batches) == len(stream)
    rows = joined(batches, POINTS)
    assert same_multiset(rows, built)  # exact: same values, each row as often as the build writes it
    assert not np.array_equal(rows, built)  # and shuffled
    loader = torch.utils.data.DataLoader(activation_stream(llama, PROMPTS, POINTS, **SETTINGS), batch_size=None)
    again = joined(loader, POINTS)
    assert np.array_equal(rows, again)  # the seed fixes the order (and a DataLoader passes batches through)
    other = joined(activation_stream(llama, PROMPTS, POINTS, **{**SETTINGS, "seed": 6}), POINTS)
    assert not np.array_equal(rows, other) and same_multiset(other, built)


def test_one_point_and_epochs(llama, built):
    stream = activation_stream(llama, PROMPTS, POINTS[:1], epochs=2, dtype="bfloat16", **SETTINGS)
    batches = list(stream)
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.bfloat16 for b in batches)
    d = built.shape[1] // 2
    first = joined(batches[:len(batches) // 2], POINTS[:1])
    second = joined(batches[len(batches) // 2:], POINTS[:1])
    want = torch.from_numpy(built[:, :d]).bfloat16().float().numpy()
    assert same_multiset(first, want) and same_multiset(second, want)
    assert not np.array_equal(first, second)  # each epoch in its own order


@pytest.mark.parametrize("stop", [1, 4, 7])
def test_resume_yields_exactly_the_rest(llama, built, stop):
    stream = activation_stream(llama, PROMPTS, POINTS, **SETTINGS)
    whole = joined(stream, POINTS)
    before = []
    for batch in stream:
        before.append(batch)
        if len(before) == stop:
            break
    state = json.loads(json.dumps(stream.state()))  # a checkpoint survives JSON
    after = list(activation_stream(llama, PROMPTS, POINTS, resume=state, **SETTINGS))
    rows = joined(before + after, POINTS)
    assert np.array_equal(rows, whole)  # the very same batches, in the same order
    assert same_multiset(rows, built)


def test_bad_arguments(llama):
    with pytest.raises(InputError, match="shuffle_buffer"):
        activation_stream(llama, PROMPTS, POINTS, batch_tokens=64, shuffle_buffer=8)
    with pytest.raises(InputError, match="pattern"):
        activation_stream(llama, PROMPTS, ["pattern.0"], batch_tokens=8, shuffle_buffer=8)
    stream = activation_stream(llama, PROMPTS, POINTS, **SETTINGS)
    with pytest.raises(InputError, match="other settings"):
        activation_stream(llama, PROMPTS, POINTS, resume=stream.state(), **{**SETTINGS, "seed": 9})


def test_positions_keep_the_build_rows(llama, tmp_path):
    want = built_rows(llama, PROMPTS, POINTS[:1], tmp_path / "probe", shard_size=4, positions=[0, -1])
    rows = joined(activation_stream(llama, PROMPTS, POINTS[:1], positions=[0, -1], **SETTINGS), POINTS[:1])
    assert len(rows) == 2 * len(PROMPTS) and same_multiset(rows, want[POINTS[0]])


def test_a_slow_consumer_pauses_the_capture(llama, monkeypatch):
    """Back-pressure: rows captured but not yet yielded never exceed the pool plus the chunks
    allowed in flight, however slowly the batches are taken."""
    import interp_engine.stream.stream as module

    captured = []
    real = module.capture_rows

    def counting(model, spec, index, texts, expected):
        rows = real(model, spec, index, texts, expected)
        captured.append(len(expected))
        return rows

    monkeypatch.setattr(module, "capture_rows", counting)
    stream = activation_stream(llama, PROMPTS * 3, POINTS[:1], prefetch=2, **SETTINGS)
    largest = int(stream.chunk_rows.max())
    yielded = 0
    for batch in stream:
        yielded += len(batch)
        time.sleep(0.01)  # a slow trainer: the producer threads get every chance to run ahead
        assert sum(captured) - yielded <= SETTINGS["shuffle_buffer"] + 3 * largest
    assert yielded == sum(captured) == stream.rows_per_epoch
