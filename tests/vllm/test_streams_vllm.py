"""Gemma 3n (AltUp, several residual streams) on the vLLM backend, against the eager backend.

vLLM's Gemma 3n layer returns its streams stacked first, ``[stream, tokens, d_model]``; the
table reads them with layout ``"s (b p) d"``. Tolerance as in the dense parity tests:
``max |vllm - eager| <= 1e-4 * max |eager|`` (fp32).
"""

from __future__ import annotations

import pytest

from interp_engine import AddressError, capture_generation, load_model, run_with_cache

from .. import tiny_moe
from ..oracles import assert_near

pytest.importorskip("vllm")

PROMPT = "Streams of thought"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = str(tiny_moe.build("gemma3n", tmp_path_factory.mktemp("vllm_gemma3n")))
    model = load_model(path, backend="vllm", max_model_len=128)
    yield model, load_model(path, backend="eager")
    model.close()


def test_every_served_site_matches_eager(pair):
    vllm, eager = pair
    info = vllm.info
    points = [f"resid_streams.{L}.{S}" for L in range(info.n_layers) for S in range(info.n_streams)]
    points += [f"{site}.{L}" for L in range(info.n_layers) for site in ("attn_out", "attn_out_post", "mlp_out",
                                                                          "mlp_out_post", "z", "q", "mlp_post")]
    points += ["logits"]
    tokens = vllm.to_tokens(PROMPT)
    got, want = run_with_cache(vllm, tokens, points), run_with_cache(eager, tokens, points)
    for point in points:
        assert_near(got[point], want[point], point)


def test_generation_matches_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens(PROMPT)
    points = ["resid_streams.3.1", "resid_streams.3.2"]
    done, got = capture_generation(vllm, tokens, points, max_tokens=4, stop_at_eos=False)
    oracle, want = capture_generation(eager, tokens, points, max_tokens=4, stop_at_eos=False)
    assert done.token_ids == oracle.token_ids
    for point in points:
        assert_near(got[point], want[point], point)


def test_bad_stream_points_on_vllm(pair):
    vllm, _ = pair
    tokens = vllm.to_tokens("Hi")
    with pytest.raises(AddressError, match=r"has streams 0\.\.2"):
        run_with_cache(vllm, tokens, ["resid_streams.0.3"])
    with pytest.raises(AddressError, match=r"residual is 3 streams.*resid_streams\.2\.0"):
        run_with_cache(vllm, tokens, ["resid_post.2"])
    with pytest.raises(AddressError, match="not served on the vllm backend; valid sites there: .*resid_streams"):
        run_with_cache(vllm, tokens, ["k.2"])
    with pytest.raises(AddressError, match="dense model and has no MoE router"):
        run_with_cache(vllm, tokens, ["router_logits.0"])
