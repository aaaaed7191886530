"""A vLLM-backed service: a tiny Llama on a vLLM replica deployed with Ray Serve, reached through
Ray and over HTTP, equal to the eager model within the cross-backend tolerance; concurrent
requests with different edits share the engine and each gets its own result."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from interp_engine import Add, capture_generation, connect, run_with_cache, serve, shutdown
from interp_engine.compare import CROSS_BACKEND

from ..oracles import assert_near

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def service(tiny_path, tmp_path_factory):
    from interp_engine.loopback import free_port, start_local_ray
    from ray import serve as ray_serve

    saved = os.environ.get("INTERP_ENGINE_CACHE")
    os.environ["INTERP_ENGINE_CACHE"] = str(tmp_path_factory.mktemp("service_cache"))
    start_local_ray(num_cpus=2)
    try:
        info = serve(str(tiny_path("llama")), name="tiny-vllm", backend="vllm", replicas=1, port=free_port(),
                     cpus_per_replica=1, env_vars={"VLLM_CPU_KVCACHE_SPACE": "1"}, max_model_len=128)
        yield info
        shutdown(info.name)
    finally:
        ray_serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("INTERP_ENGINE_CACHE", None)
        else:
            os.environ["INTERP_ENGINE_CACHE"] = saved


def test_a_vllm_service_equals_the_eager_model(service, eager_models):
    eager = eager_models("llama")
    batch = eager.to_tokens(["The quick brown fox", "jumps", "over the lazy dog"])
    points = ["resid_post.1", "z.0", "logits"]
    want = run_with_cache(eager, batch, points)
    for model in (connect(service.name), connect(service.url, token=service.token)):
        assert model.backend == "vllm" and model.batched  # one prompt per replica call; the client splits
        got = run_with_cache(model, batch, points)
        assert torch.equal(got.tokens, batch)
        for point in points:
            assert_near(got[point], want[point], point, rel=CROSS_BACKEND)
        completion, cache = capture_generation(model, eager.to_tokens("Hello"), ["resid_post.2"], max_tokens=4)
        local, local_cache = capture_generation(eager, eager.to_tokens("Hello"), ["resid_post.2"], max_tokens=4)
        assert completion.token_ids == local.token_ids
        assert_near(cache["resid_post.2"], local_cache["resid_post.2"], "generation", rel=CROSS_BACKEND)


def test_concurrent_edited_requests_each_get_their_own_result(service, eager_models):
    """Eight async captures in flight at once on one vLLM replica (continuous batching), half of
    them steered: each equals the same request alone on the eager model."""
    eager = eager_models("llama")
    tokens = eager.to_tokens("Paris is in")
    vectors = [torch.randn(eager.d_model, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    edits = [{"resid_post.0": Add(v, scale=3.0)} if i % 2 else None for i, v in enumerate(vectors)]
    for model in (connect(service.name), connect(service.url, token=service.token)):
        async def all_at_once():
            return await asyncio.gather(*(model.capture(tokens, ["resid_post.2"], edits=e) for e in edits))

        got = asyncio.run(all_at_once())
        for i, (result, edit) in enumerate(zip(got, edits)):
            want = run_with_cache(eager, tokens, ["resid_post.2"], edits=edit)["resid_post.2"]
            assert_near(result[next(iter(result))], want, f"request {i}", rel=CROSS_BACKEND)
