"""The worker-side row selection of the vLLM backend, without an engine: one forward's rows for
the requests that want a site, as a tensor of their own."""

import torch

from interp_engine.backends.vllm.worker.hooks import _select


def test_select_sums_parts_into_a_fresh_tensor():
    a, b = torch.arange(12.0).reshape(6, 2), torch.ones(6, 2)
    contiguous = _select([a, b], slice(1, 3))
    assert torch.equal(contiguous, a[1:3] + 1)
    alone = _select([a], slice(1, 3))
    a[1:3] = -5  # vLLM's fused norms write into their inputs later: the copy must not follow
    assert torch.equal(alone, torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    picked = _select([a, b], torch.tensor([0, 4, 5]))
    assert torch.equal(picked, torch.stack([a[0], a[4], a[5]]) + 1)
