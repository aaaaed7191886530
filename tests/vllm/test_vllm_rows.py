"""The worker-side row store of the vLLM backend, without an engine: requests recorded together in
one chunk per forward and address, each taken back in position order, with recomputed positions
keeping their later value and every returned tensor independent of the others."""

import torch

from interp_engine.backends.vllm.worker.rows import RowStore

A, B = "resid_post.0", "resid_post.1"


def forward(store, members, chunks):
    """Record one forward: ``members`` = [(rid, positions)], ``chunks`` = {address: rows of all}."""
    group = store.group([(rid, len(p), torch.tensor(p)) for rid, p in members])
    group.chunks.update(chunks)
    return group


def test_requests_sharing_forwards_get_their_own_rows_in_order():
    store = RowStore()
    store.open("x"), store.open("y")
    prefill = torch.arange(10.0).reshape(5, 2)  # x: positions 0-2 (rows 0-2), y: positions 0-1 (rows 3-4)
    first = forward(store, [("x", [0, 1, 2]), ("y", [0, 1])], {A: prefill, B: -prefill})
    decode = torch.tensor([[100.0, 100.0], [200.0, 200.0]])
    step = forward(store, [("x", [3]), ("y", [2])], {A: decode, B: -decode})
    x = store.take("x")
    assert torch.equal(x[A][0], torch.cat([prefill[:3], decode[:1]])) and x[A][1].tolist() == [0, 1, 2, 3]
    assert torch.equal(x[B][0], -x[A][0])
    assert first.stacks() is None and [batch for batch, _ in step.stacks()] == [(A, B)]  # a prefill is sliced, a decode step stacked
    y = store.take("y")
    assert torch.equal(y[A][0], torch.cat([prefill[3:], decode[1:]])) and y[A][1].tolist() == [0, 1, 2]
    # nothing returned shares storage with another address or request (safetensors, Ray, IPC copy each whole)
    storages = {t.untyped_storage().data_ptr() for r in (x, y) for t, _ in r.values()}
    assert len(storages) == 4
    assert store.take("x") == {}  # taken once


def test_recompute_keeps_the_later_value_and_shows_gaps():
    store = RowStore()
    store.open("x")
    forward(store, [("x", [0, 1, 2])], {A: torch.zeros(3, 1)})
    forward(store, [("x", [1, 2])], {A: torch.ones(2, 1)})  # positions 1, 2 recomputed
    forward(store, [("x", [4])], {A: torch.full((1, 1), 4.0)})  # position 3 never computed
    rows, positions = store.take("x")[A]
    assert rows[:, 0].tolist() == [0.0, 1.0, 1.0, 4.0]
    assert positions.tolist() == [0, 1, 2, 4]  # the gap shows: the driver refuses it


def test_requests_that_want_different_addresses():
    """x wants A and B, y only A: a forward has one group per set of requesters, and a request's
    address is joined across those groups in the order computed."""
    store = RowStore()
    store.open("x"), store.open("y")
    both = forward(store, [("x", [0, 1]), ("y", [0])], {A: torch.tensor([[1.0], [2.0], [3.0]])})
    assert both.rows["y"][0] == 2
    forward(store, [("x", [0, 1])], {B: torch.tensor([[5.0], [6.0]])})
    forward(store, [("x", [2]), ("y", [1])], {A: torch.tensor([[7.0], [8.0]])})
    forward(store, [("x", [2])], {B: torch.tensor([[9.0]])})
    x, y = store.take("x"), store.take("y")
    assert x[A][0][:, 0].tolist() == [1.0, 2.0, 7.0] and x[A][1].tolist() == [0, 1, 2]
    assert x[B][0][:, 0].tolist() == [5.0, 6.0, 9.0] and x[B][1].tolist() == [0, 1, 2]
    assert y[A][0][:, 0].tolist() == [3.0, 8.0] and set(y) == {A}


def test_rows_of_different_shapes_and_dtypes():
    store = RowStore()
    store.open("x")
    forward(store, [("x", [0])], {A: torch.ones(1, 4), "logits": torch.ones(1, 9), "expert_indices.0": torch.ones(1, 2, dtype=torch.long)})
    out = store.take("x")
    assert [out[k][0].shape[-1] for k in (A, "logits", "expert_indices.0")] == [4, 9, 2]
    assert out["expert_indices.0"][0].dtype == torch.long


def test_dropped_request_frees_nothing_of_the_others():
    store = RowStore()
    store.open("x"), store.open("y")
    forward(store, [("x", [0]), ("y", [0])], {A: torch.tensor([[1.0], [2.0]])})
    store.drop("x")
    assert store.take("y")[A][0].tolist() == [[2.0]]


def test_stacks_stay_small(monkeypatch):
    """Chunks are stacked a few at a time (never one huge allocation), and the rows come back the same."""
    from interp_engine.backends.vllm.worker import rows as vllm_rows

    monkeypatch.setattr(vllm_rows, "STACK_BYTES", 3 * 2 * 4)  # three [2, 1] float32 chunks a stack
    store = RowStore()
    store.open("x"), store.open("y")
    addresses = [f"resid_post.{i}" for i in range(7)]
    group = forward(store, [("x", [0]), ("y", [0])], {a: torch.tensor([[i], [-i]], dtype=torch.float32) for i, a in enumerate(addresses)})
    forward(store, [("x", [1]), ("y", [1])], {a: torch.tensor([[10.0 + i], [0.0]]) for i, a in enumerate(addresses)})
    x = store.take("x")
    assert [len(batch) for batch, _ in group.stacks()] == [3, 3, 1]
    assert [x[a][0][:, 0].tolist() for a in addresses] == [[i, 10.0 + i] for i in range(7)]
    assert store.take("y")["resid_post.2"][0][:, 0].tolist() == [-2.0, 0.0]


def test_a_lone_request_gets_its_chunk_without_a_copy():
    store = RowStore()
    store.open("x")
    chunk = torch.zeros(3, 2)
    forward(store, [("x", [0, 1, 2])], {A: chunk})
    rows, positions = store.take("x")[A]
    assert rows is chunk and positions.tolist() == [0, 1, 2]
