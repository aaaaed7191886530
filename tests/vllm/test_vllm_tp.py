"""Tensor parallelism on the vLLM backend: two worker processes on this CPU.

The tiny Llama here has one kv head, so with two ranks the query heads are split between the
ranks while the kv head is replicated on both: the two ways ``z``/``q`` and ``k``/``v`` are put
back together are both exercised. Oracles: the same weights at ``tensor_parallel_size=1``, and
the eager backend.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from interp_engine import Address, capture_generation, load_model, run_with_cache

from .. import tiny
from ..probes import engine_state

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")  # a vllm dependency

SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "z", "q", "k", "v", "mlp_post")
TP_EQUALS_TP1 = ("resid_post", "attn_out", "mlp_out", "z")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(tiny.build_one_kv_head(tmp_path_factory.mktemp("tp_tiny")))


@pytest.fixture(scope="module")
def children_before():
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def tp2(path, children_before):
    with load_model(path, backend="vllm", max_model_len=128, tensor_parallel_size=2) as model:
        yield model


@pytest.fixture(scope="module")
def tp1(path):
    with load_model(path, backend="vllm", max_model_len=128) as model:
        yield model


def points(model):
    return [f"{s}.{layer}" for layer in range(model.n_layers) for s in SITES] + ["logits"]


def test_tp2_equals_tp1(tp2, tp1):
    assert [len(engine_state(tp2)), len(engine_state(tp1))] == [2, 1]
    # workers are driven by method name with plain data: no pickled callables
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ
    tokens = tp1.to_tokens("tensor parallel capture")
    a = run_with_cache(tp2, tokens, points(tp1))
    b = run_with_cache(tp1, tokens, points(tp1))
    for point in points(tp1):
        assert a[point].shape == b[point].shape, point
        if point.split(".")[0] in TP_EQUALS_TP1:
            torch.testing.assert_close(a[point], b[point], rtol=1e-5, atol=1e-5, msg=point)
        err = float((a[point] - b[point]).abs().max())
        assert err <= 1e-4 * float(b[point].abs().max()), point  # every other site too


def test_tp2_equals_eager_at_every_site(tp2, path):
    eager = load_model(path, backend="eager")
    tokens = eager.to_tokens("every site, two ranks")
    a = run_with_cache(tp2, tokens, points(tp2))
    b = run_with_cache(eager, tokens, points(tp2))
    for point in points(tp2):
        err = float((a[point] - b[point]).abs().max())
        assert err <= 1e-4 * float(b[point].abs().max()), point
    torch.testing.assert_close(tp2.o_proj_weight(1), eager.o_proj_weight(1).detach())


def test_tp2_generation_and_async(tp2, tp1):
    tokens = tp1.to_tokens("Two ranks")
    completion, cache = capture_generation(tp2, tokens, ["z.1", "resid_post.2"], max_tokens=6)
    expected, oracle = capture_generation(tp1, tokens, ["z.1", "resid_post.2"], max_tokens=6)
    assert completion.token_ids == expected.token_ids
    for point in ("z.1", "resid_post.2"):
        torch.testing.assert_close(cache[point], oracle[point], rtol=1e-5, atol=1e-5)
    prompts = [tp1.to_tokens("p" * (i + 1)) for i in range(6)]

    async def all_at_once():
        return await asyncio.gather(*(tp2.capture(p, ["z.0"]) for p in prompts))

    for p, got in zip(prompts, asyncio.run(all_at_once())):
        torch.testing.assert_close(got[Address("z", 0)], run_with_cache(tp1, p, ["z.0"])["z.0"], rtol=1e-5, atol=1e-5)


def test_close_leaves_no_worker_processes(tp2, tp1, children_before):
    workers = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
    workers = [p for p in workers if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) >= 2  # one per rank while serving
    tp2.close()
    tp2.close()  # idempotent
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"worker processes left after close: {[p.pid for p in alive]}"
    with pytest.raises(RuntimeError, match="closed"):
        run_with_cache(tp2, tp2.to_tokens("after close"), ["z.0"])
    # the other engine of this process still serves after this one's shutdown
    assert run_with_cache(tp1, tp1.to_tokens("still here"), ["z.0"])["z.0"].shape[1] == 11
