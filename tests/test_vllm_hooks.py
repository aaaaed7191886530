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
    positions = torch.tensor([0, 1, 2, 0, 1])  # one forward: request A rows 0-2, request B rows 3-4
    chunk = torch.arange(10.0).reshape(5, 2)
    step2 = torch.tensor([3])
    entries = [(positions, 0, chunk, 0, 3), (step2, 0, torch.tensor([[7.0, 7.0]]), 0, 1)]
    rows, seen = _dense(entries)
    assert torch.equal(rows, torch.cat([chunk[:3], torch.tensor([[7.0, 7.0]])])) and bool(seen.all())


def test_dense_recompute_keeps_the_later_value_and_reports_gaps():
    first = (torch.tensor([0, 1, 2]), 0, torch.zeros(3, 1), 0, 3)
    again = (torch.tensor([1, 2]), 0, torch.ones(2, 1), 0, 2)  # positions 1, 2 recomputed
    later = (torch.tensor([4]), 0, torch.full((1, 1), 4.0), 0, 1)  # position 3 never computed
    rows, seen = _dense([first, again, later])
    assert rows[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0, 4.0]
    assert seen.tolist() == [True, True, True, False, True]
