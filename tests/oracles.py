"""Comparison helpers shared by the tests: the equality contract of interp_engine/compare.py.

Bitwise (``torch.equal``) only where the computation is provably the same; ``assert_near``
(relative error against the tensor's scale) everywhere else.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from interp_engine.compare import CROSS_BACKEND, SAME_BACKEND, relative_error

#: relative tolerance of vLLM against the eager backend (fp32): max error / max magnitude
REL = CROSS_BACKEND
#: relative tolerance of the same backend computing the same values differently
REL_SAME = SAME_BACKEND


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = REL) -> None:
    """Same shape, and the largest absolute error at most ``rel`` times the largest magnitude."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = relative_error(got, want)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"


def assert_same(got: dict, want: dict) -> None:
    """The same addresses in the same order, every tensor bit for bit (the same computation)."""
    assert list(got) == list(want)
    for address, tensor in want.items():
        assert torch.equal(got[address], tensor), address


def assert_caches_near(got, want, rel: float = REL_SAME) -> None:
    """Same addresses in the same order, same tokens and mask, every tensor within ``rel``."""
    assert list(got) == list(want)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
    for address, tensor in want.items():
        assert_near(got[address], tensor, str(address), rel)


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch threads in this process, then restore the count (so a
    comparison with a replica pinned to ``n`` threads is the same computation, whatever an
    earlier test — or a vLLM engine — set the process to).

    ``torch._C.set_num_threads``: a process that hosts a vLLM CPU worker has ``torch.set_num_threads``
    replaced by a no-op. Threads started inside the block (``asyncio.run``'s executor) take the
    count at their first parallel op."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(n)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def row_chunks(tokens: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """A padded batch cut into ``parts`` contiguous row chunks at its own width: the shards an
    eager cluster with ``parts`` replicas runs (docs/CLUSTER.md, "Batches")."""
    n = min(parts, tokens.shape[0])
    bounds = np.linspace(0, tokens.shape[0], n + 1).astype(int)
    return [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
