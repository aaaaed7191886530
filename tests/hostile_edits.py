"""Hostile edit values, for the catalogue in test_hostile.py (on the eager model, the vLLM engine and
the 2-replica cluster model alike), and the checks that one request's non-finite values never
reach another request's results.

``CASES``: name -> (call, error, says, valid[, backends[, never]]), each a refused edit whose
message names the edit, the address and the fix. ``CHECKS``: functions of a ``Hostile`` that
assert what must hold (numpy scalars accepted as numbers; a NaN request among clean concurrent
ones refused while the clean ones are right; a poisoned KV cache never read by the next request);
a check that does not apply to a backend skips.
"""

from __future__ import annotations

import dataclasses

import asyncio

import numpy as np
import pytest
import torch

from interp_engine import Add, Address, InputError, Scale, Set, capture_generation, run_with_cache
from interp_engine.edits import Planned
from interp_engine.positions import check_spec

from .oracles import REL_SAME, assert_near

POINTS = ["resid_post.1", "z.2", "logits"]
NAN, INF = float("nan"), float("inf")
FINITE = "pass finite numbers"


def _d(h) -> int:
    return h.model.info.d_model


def _with(d: int, index: int, value: float) -> torch.Tensor:
    vector = torch.linspace(-1, 1, d)
    vector[index] = value
    return vector


def edit(h, point, e, **options):
    """run_with_cache (or, with sampling options, capture_generation) with one edit."""
    if options:
        return capture_generation(h.model, h.tokens(), ["resid_post.0"], edits={point: e}, **options)
    return run_with_cache(h.model, h.tokens(), POINTS, edits={point: e})


def _async_edit(h, point, e):
    return asyncio.run(h.model.capture(h.tokens(), ["resid_post.0"], edits={point: e}))


CASES = {
    "NaN in an Add vector": (lambda h: edit(h, "resid_post.1", Add(_with(_d(h), 3, NAN))), InputError,
                             r"edit on resid_post\.1: Add's vector holds nan at index \[3\]", FINITE),
    "inf in an Add vector on mlp_out": (lambda h: edit(h, "mlp_out.2", Add(_with(_d(h), 0, INF))), InputError,
                                        r"edit on mlp_out\.2: Add's vector holds inf", FINITE),
    "Scale(inf)": (lambda h: edit(h, "mlp_out.2", Scale(INF)), InputError,
                   r"edit on mlp_out\.2: Scale's factor must be a finite number.*, got inf", FINITE),
    "Scale(nan) on z": (lambda h: edit(h, "z.1", Scale(NAN, heads=[0])), InputError,
                        r"edit on z\.1: Scale's factor must be a finite number.*, got nan", FINITE),
    "Set(nan) on v at the last position": (lambda h: edit(h, "v.0", Set(NAN, positions=[-1])), InputError,
                                           r"edit on v\.0: Set's value must be a finite number .*got nan", FINITE),
    "-inf in a per-head Set": (lambda h: edit(h, "z.0", Set(torch.full((1, h.model.info.d_head), -INF), heads=[1])),
                               InputError, r"edit on z\.0: Set's value holds -inf at index \[0, 0\]", FINITE),
    "Scale beyond float32": (lambda h: edit(h, "resid_post.1", Scale(1e39)), InputError,
                             r"Scale's factor must be a finite number within float32 .*got 1e\+39", FINITE),
    "an int too large for a float as a value": (lambda h: edit(h, "attn_out.0", Set(10**400)), InputError,
                                                r"edit on attn_out\.0: Set's value must be a finite number within "
                                                r"float32 .*\(401 digits\)", FINITE),
    "a list holding a complex number": (lambda h: edit(h, "resid_post.1", Add([1j] + [0.0] * (_d(h) - 1))),
                                        InputError, r"Add's vector is complex", r"value\.real"),
    "Add(scale=inf)": (lambda h: edit(h, "resid_post.1", Add(torch.ones(_d(h)), scale=INF)), InputError,
                       r"edit on resid_post\.1: Add's scale must be a finite number.*, got inf", FINITE),
    "Add(scale=nan)": (lambda h: edit(h, "resid_pre.2", Add(torch.ones(_d(h)), scale=NAN)), InputError,
                       r"edit on resid_pre\.2: Add's scale must be a finite number.*, got nan", FINITE),
    "Add whose scale * vector overflows": (lambda h: edit(h, "resid_post.0", Add(torch.full((_d(h),), 3e38),
                                                                                    scale=10.0)), InputError,
                                           r"edit on resid_post\.0: Add's scale \* vector overflows float32",
                                           "lower|finite numbers"),
    "float64 value beyond float32": (lambda h: edit(h, "resid_mid.1", Set(torch.full((_d(h),), 1e300,
                                                                                     dtype=torch.float64))),
                                     InputError, r"edit on resid_mid\.1: Set's value holds inf at index \[0\] once "
                                                 r"converted to float32", FINITE),
    "NaN vector with norm_relative": (lambda h: edit(h, "resid_post.1", Add(_with(_d(h), 5, NAN),
                                                                            norm_relative=True)), InputError,
                                      r"edit on resid_post\.1: Add's vector holds nan", FINITE,
                                      ("eager", "vllm", "cluster"), "nonzero norm"),
    "complex Add vector": (lambda h: edit(h, "resid_post.1", Add(torch.ones(_d(h), dtype=torch.complex64))),
                           InputError, r"edit on resid_post\.1: Add's vector is complex", r"value\.real"),
    "complex Set value": (lambda h: edit(h, "mlp_out.1", Set(1 + 2j)), InputError,
                          r"edit on mlp_out\.1: Set's value is complex", r"value\.real"),
    "complex numpy vector": (lambda h: edit(h, "resid_post.1", Add(np.ones(_d(h), dtype=np.complex128))),
                             InputError, r"Add's vector is complex", r"value\.real"),
    "meta-device vector": (lambda h: edit(h, "resid_post.1", Add(torch.ones(_d(h), device="meta"))), InputError,
                           r"edit on resid_post\.1: Add's vector is on the meta device", "device='cpu'"),
    "bool Set value": (lambda h: edit(h, "resid_post.1", Set(torch.ones(_d(h), dtype=torch.bool))), InputError,
                       r"edit on resid_post\.1: Set's value is a bool tensor", r"mask\.float\(\)"),
    "NaN in a whole-batch Set": (lambda h: edit(h, "resid_post.1", Set(torch.full((*h.tokens().shape, _d(h)), NAN))),
                                 InputError, r"edit on resid_post\.1: Set's value holds nan at index \[0, 0, 0\]",
                                 FINITE),  # a whole-batch value is taken on every backend (batched patching)
    "NaN edit on a sampled generation": (lambda h: edit(h, "resid_post.1", Add(_with(_d(h), 1, NAN)), max_tokens=4,
                                                        temperature=0.8, seed=3), InputError,
                                         r"edit on resid_post\.1: Add's vector holds nan", FINITE),
    "inf edit in an async capture": (lambda h: _async_edit(h, "v.1", Set(INF)), InputError,
                                     r"edit on v\.1: Set's value must be a finite number.*got inf", FINITE),
    "np.float64('nan') as a scale": (lambda h: edit(h, "resid_post.1", Scale(np.float64("nan"))), InputError,
                                     "Scale's factor must be a finite number.*, got np.float64.nan.", FINITE),
}


# -- checks ----------------------------------------------------------------------------------------
def numpy_scalars_are_numbers(h):
    """``np.float32`` scales and factors, ``np.int64`` positions and heads mean what their Python
    equivalents mean: the same edit, the same result (``torch.equal``: the same computation)."""
    vector = torch.linspace(-2, 2, _d(h))
    as_python = {"resid_post.1": Add(vector, scale=0.5, positions=[1, -1]), "z.2": Scale(3.0, heads=[1])}
    as_numpy = {"resid_post.1": Add(vector.numpy(), scale=np.float32(0.5), positions=[np.int64(1), np.int64(-1)]),
                "z.2": Scale(np.float64(3.0), heads=[np.int64(1)])}
    want = run_with_cache(h.model, h.tokens(), POINTS, edits=as_python)
    got = run_with_cache(h.model, h.tokens(), POINTS, edits=as_numpy)
    plain = run_with_cache(h.model, h.tokens(), POINTS)
    assert not torch.equal(want["logits"], plain["logits"]), "the edit changed nothing"
    for address in want:
        assert torch.equal(got[address], want[address]), f"{address}: numpy scalars edited differently"
    assert check_spec(np.int64(-1)) == -1 and check_spec(np.array([0, 2])) == [0, 2]


def a_nan_request_among_clean_ones_is_refused_alone(h):
    """Concurrent async captures with one NaN-edited request: that one is refused, the clean ones
    each return what the same request returns alone (within REL_SAME: batched with others, the
    computation may differ by rounding) and no non-finite value."""
    prompts = [h.model.to_tokens(f"clean request {i}" + " more" * i) for i in range(4)]
    bad = {"resid_post.1": Add(_with(_d(h), 2, NAN))}

    async def together():
        calls = [h.model.capture(p, POINTS) for p in prompts[:2]]
        calls.append(h.model.capture(prompts[0], POINTS, edits=bad))
        calls += [h.model.capture(p, POINTS) for p in prompts[2:]]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(together())
    refused = results.pop(2)
    assert isinstance(refused, InputError) and "Add's vector holds nan" in str(refused), refused
    for i, (tokens, got) in enumerate(zip(prompts, results)):
        alone = asyncio.run(h.model.capture(tokens, POINTS))
        for address, value in alone.items():
            assert torch.isfinite(got[address]).all(), f"clean request {i}: {address} is not finite"
            assert_near(got[address], value, f"clean request {i} {address}", REL_SAME)


def _vllm_only(h):
    if h.backend != "vllm":
        pytest.skip("the KV cache of a vLLM engine")


def _long_tokens(h):
    """Longer than the reference prompt, so that its KV slots cover the reference's tail."""
    return h.model.to_tokens("a long prompt that writes its keys and values far past the reference")


def _on_worker(h, fn):
    """``fn(worker)`` on the engine's own thread (this process: TP=1)."""
    return h.model._loop.call(fn).result()[0]


def _non_finite_kv(worker) -> int:
    return sum(int((~torch.isfinite(kv)).sum()) for kv in worker.model_runner.kv_caches)


def _fill_kv_with_nan(worker) -> None:
    for kv in worker.model_runner.kv_caches:
        kv.fill_(NAN)


# The three poison checks below leave non-finite keys and values in the KV cache; the catalogue's
# test then checks that the next ordinary requests are exact (assert_serves_as_fresh).
def an_overflowing_edit_is_its_own_requests_problem(h):
    """A finite edit that overflows inside the model (``Scale(3e38)`` on ``v.0``: later layers'
    keys and values become inf / NaN) is accepted; only its own request returns non-finite values."""
    _vllm_only(h)
    poisoned = run_with_cache(h.model, _long_tokens(h), ["logits"], edits={"v.0": Scale(3e38)})
    assert not torch.isfinite(poisoned["logits"]).all(), "the overflow did not happen: the check proves nothing"
    assert _on_worker(h, _non_finite_kv) > 0, "no non-finite key or value reached the KV cache"


def a_worker_level_nan_edit_is_its_own_requests_problem(h):
    """A NaN edit that skips the public check (a planned edit built by hand and sent through the
    backend's own path to the workers as data: no function anywhere) writes NaN keys and values."""
    _vllm_only(h)
    request = h.model.request(_long_tokens(h), ["logits"])
    v0 = Address("v", 0)
    cache = h.model.execute(dataclasses.replace(request, edits={v0: (Planned(v0, Set(torch.tensor(NAN))),)}))
    assert cache["logits"].isnan().all(), "the NaN did not reach the model: the check proves nothing"
    assert _on_worker(h, _non_finite_kv) > 0, "no NaN reached the KV cache"


def every_kv_block_set_to_nan(h):
    """The lowest level: every KV cache block of the idle engine set to NaN (what any earlier
    request could have left in any block). The engine zeroes each block before its next holder
    runs (and says how many it zeroed)."""
    _vllm_only(h)
    from .probes import engine_state

    before = engine_state(h.model)[0]["kv_blocks_zeroed"]
    _on_worker(h, _fill_kv_with_nan)
    cache = run_with_cache(h.model, h.tokens(), POINTS)
    assert all(torch.isfinite(value).all() for value in cache.values())
    assert engine_state(h.model)[0]["kv_blocks_zeroed"] > before


CHECKS = [numpy_scalars_are_numbers, a_nan_request_among_clean_ones_is_refused_alone,
          an_overflowing_edit_is_its_own_requests_problem, a_worker_level_nan_edit_is_its_own_requests_problem,
          every_kv_block_set_to_nan]
