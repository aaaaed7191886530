"""The worker-side row bookkeeping of the vLLM backend, without an engine: selecting one
forward's rows for the requests that want a site, and putting a request's rows in position
order when positions arrive out of order or are computed twice (recompute after preemption)."""

import torch

from interp_engine.backends.vllm_hooks import _dense, _select


def test_select_sums_parts_into_a_fresh_tensor():
    a, b = torch.arange(12.0).reshape(6, 2), torch.ones(6, 2)
    contiguous = _select([a, b], slice(1, 3))
    assert torch.equal(contiguous, a[1:3] + 1)
    alone = _select([a], slice(1, 3))
    a[1:3] = -5  # vLLM's fused norms write into their inputs later: the copy must not follow
    assert torch.equal(alone, torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    picked = _select([a, b], torch.tensor([0, 4, 5]))
    assert torch.equal(picked, torch.stack([a[0], a[4], a[5]]) + 1)


def test_dense_in_order_is_a_concatenation():
    # one forward: request A rows 0-2 of a chunk that also holds request B's rows 3-4
    chunk = torch.arange(10.0).reshape(5, 2)
    entries = [(torch.tensor([0, 1, 2]), chunk, 0, 3), (torch.tensor([3]), torch.tensor([[7.0, 7.0]]), 0, 1)]
    rows, positions = _dense(entries)
    assert torch.equal(rows, torch.cat([chunk[:3], torch.tensor([[7.0, 7.0]])]))
    assert positions.tolist() == [0, 1, 2, 3]


def test_dense_recompute_keeps_the_later_value_and_reports_gaps():
    first = (torch.tensor([0, 1, 2]), torch.zeros(3, 1), 0, 3)
    again = (torch.tensor([1, 2]), torch.ones(2, 1), 0, 2)  # positions 1, 2 recomputed
    later = (torch.tensor([4]), torch.full((1, 1), 4.0), 0, 1)  # position 3 never computed
    rows, positions = _dense([first, again, later])
    assert rows[:, 0].tolist() == [0.0, 1.0, 1.0, 4.0]
    assert positions.tolist() == [0, 1, 2, 4]  # the gap shows: the driver refuses it


def test_dense_keeps_only_selected_rows():
    """A selection (positions=) leaves each forward's unselected rows out: only those listed come back."""
    prefill = (torch.tensor([5]), torch.full((1, 3), 5.0), 0, 1)  # position 5 of a 6-token prompt
    decode = (torch.tensor([6]), torch.full((1, 3), 6.0), 0, 1)
    rows, positions = _dense([prefill, decode])
    assert rows.shape == (2, 3) and positions.tolist() == [5, 6]
