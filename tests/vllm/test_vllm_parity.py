"""The vLLM backend against the eager backend on the same weights, for every dense family.

One vLLM engine per family (module-scoped, parametrised: pytest finishes one family's tests and
closes its engine before starting the next). The oracle is the eager backend, which reads the
same address space from Hugging Face transformers with hooks. Tolerance: for every site,
``max |vllm - eager| <= 1e-4 * max |eager|`` (fp32; the kernels differ, the maths does not).
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import capture_generation, head_contributions, run_with_cache

from .. import tiny
from ..oracles import assert_near
from ..tiny import DENSE_FAMILIES

pytest.importorskip("vllm")

SITES = ("resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post", "resid_post", "z", "q", "k",
         "v", "mlp_post")


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def family(request):
    return request.param


#: vLLM 0.32's Qwen2 ignores ``config.head_dim`` (it uses hidden_size / heads), so the tiny Qwen2
#: gets a hidden size that agrees with its head_dim; real Qwen2 checkpoints always agree.
VLLM_COMPATIBLE = {"qwen2": {"hidden_size": 256}}


@pytest.fixture(scope="session")
def vllm_tiny_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tiny")

    def build(family):
        config = tiny.configs()[family]
        for key, value in VLLM_COMPATIBLE.get(family, {}).items():
            setattr(config, key, value)
        return tiny.build(family, root, config=config)

    return build


@pytest.fixture(scope="module")
def pair(family, vllm_tiny_path):
    """(vllm model, eager model) of one family, on the same weights."""
    from interp_engine import load_model

    path = str(vllm_tiny_path(family))
    model = load_model(path, backend="vllm", max_model_len=128)
    yield model, load_model(path, backend="eager")
    model.close()


def every_point(model) -> list[str]:
    return [f"{site}.{layer}" for layer in range(model.n_layers) for site in SITES] + ["logits"]


def test_every_site_matches_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens("The quick brown fox jumps over the lazy dog.")
    points = every_point(vllm)
    got = run_with_cache(vllm, tokens, points)
    want = run_with_cache(eager, tokens, points)
    assert got.backend == "vllm" and torch.equal(got.tokens, tokens)
    for point in points:
        assert_near(got[point], want[point], point)


def test_identities_hold(pair):
    vllm, _ = pair
    tokens = vllm.to_tokens("identities")
    layer = vllm.n_layers - 1
    c = run_with_cache(vllm, tokens, [f"{s}.{layer}" for s in ("resid_pre", "attn_out_post", "resid_mid", "mlp_out_post",
                                                              "resid_post")] + ["resid_post.0", "resid_pre.1"])
    torch.testing.assert_close(c.get("resid_pre", layer) + c.get("attn_out_post", layer), c.get("resid_mid", layer))
    torch.testing.assert_close(c.get("resid_mid", layer) + c.get("mlp_out_post", layer), c.get("resid_post", layer))
    torch.testing.assert_close(c.get("resid_post", 0), c.get("resid_pre", 1))


def test_head_contributions_match_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens("heads")
    for layer in range(vllm.n_layers):
        assert_near(vllm.o_proj_weight(layer), eager.o_proj_weight(layer).detach(), f"o_proj.{layer}")
    got = run_with_cache(vllm, tokens, ["z.1", "attn_out.1"])
    want = run_with_cache(eager, tokens, ["z.1"])
    contributions = head_contributions(vllm, got, 1)
    assert_near(contributions, head_contributions(eager, want, 1), "head_contributions.1")


def test_generation_matches_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens("Once upon a time")
    points = ["resid_post.0", "z.1", "mlp_out.2", "k.2", "logits"]
    completion, cache = capture_generation(vllm, tokens, points, max_tokens=10)
    expected, oracle = capture_generation(eager, tokens, points, max_tokens=10)
    assert completion.token_ids == expected.token_ids
    assert completion.text == expected.text and completion.finish_reason == expected.finish_reason
    n = tokens.shape[1] + len(completion.token_ids) - 1
    assert torch.equal(cache.tokens, oracle.tokens) and cache.tokens.shape == (1, n)
    for point in points:
        assert cache[point].shape[1] == n
        assert_near(cache[point], oracle[point], f"{point} while generating")
