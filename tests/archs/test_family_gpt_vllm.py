"""GPT-2 (vLLM's own model code) and GPT-NeoX, parallel and sequential (vLLM's Transformers backend:
the Hugging Face modules inside vLLM), on the vLLM backend against the eager backend on the same
weights, which tests/archs/test_family_gpt2.py and test_family_neox.py check against HF and by hand.
Tolerance: 1e-4 relative (fp32). One engine per family, module-scoped.
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import (Add, AddressError, Scale, Set, Zero, capture_generation, head_contributions,
                           logit_attribution, run_with_cache)

from .. import tiny_gpt
from ..oracles import assert_near

pytest.importorskip("vllm")

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox", "gpt_neox_sequential"])
def name(request):
    return request.param


@pytest.fixture(scope="module")
def pair(name, tiny_root):
    """(vllm model, eager model) of one family, on the same weights."""
    from interp_engine import load_model

    path = str(tiny_gpt.build(name, tiny_root))
    model = load_model(path, backend="vllm", max_model_len=128)
    yield model, load_model(path, backend="eager")
    model.close()


def _points(model) -> list[str]:
    return [str(a) for a in model.points() if a.name != "resid_streams"]


def test_every_served_site_matches_eager(name, pair):
    vllm, eager = pair
    names = {a.name for a in vllm.points()}
    want_names = {"resid_pre", "attn_out", "attn_out_post", "mlp_out", "mlp_out_post", "resid_post", "z", "mlp_post",
                  "resid_streams", "final_norm", "logits"}
    want_names |= {"resid_mid"} if name != "gpt_neox" else set()
    want_names |= {"q", "k", "v"} if name == "gpt2" else set()
    assert names == want_names
    tokens = vllm.to_tokens(PROMPT)
    points = _points(vllm)
    got, want = run_with_cache(vllm, tokens, points), run_with_cache(eager, tokens, points)
    for point in points:
        assert_near(got[point], want[point], point)


def test_refusals_give_their_reason(name, pair):
    vllm, _ = pair
    tokens = vllm.to_tokens(PROMPT)
    if name.startswith("gpt_neox"):
        with pytest.raises(AddressError, match="Transformers backend, which calls its attention kernel's forward"):
            run_with_cache(vllm, tokens, ["q.0"])
    if name == "gpt_neox":
        with pytest.raises(AddressError, match="use_parallel_residual=True"):
            run_with_cache(vllm, tokens, ["resid_mid.0"])


def test_weights_read_from_the_workers_equal_eagers(pair):
    """vLLM loads GPT-2's Conv1D weights transposed: its output projection must come back as the
    eager record's linear_weight gives it, and the fetched final norm (a LayerNorm) and W_U too."""
    vllm, eager = pair
    for L in range(vllm.n_layers):
        assert_near(vllm.o_proj_weight(L), eager.o_proj_weight(L), f"o_proj_weight({L})", 1e-6)
    assert_near(vllm.unembed_weight(), eager.unembed_weight(), "W_U", 1e-6)
    resid = torch.randn(2, 3, vllm.d_model, generator=torch.Generator().manual_seed(0))
    assert_near(vllm.final_norm(resid), eager.final_norm(resid), "final norm", 1e-6)
    tokens = vllm.to_tokens(PROMPT)
    points = ["resid_pre.0", "attn_out_post", "mlp_out_post", "resid_post", "z.1", "logits"]
    got, want = run_with_cache(vllm, tokens, points), run_with_cache(eager, tokens, points)
    assert_near(head_contributions(vllm, got, 1), head_contributions(eager, want, 1), "head_contributions")
    ids = want["logits"].argmax(-1)
    assert_near(logit_attribution(vllm, got, ids), logit_attribution(eager, want, ids), "logit_attribution")


def test_edits_match_eager(name, pair):
    vllm, eager = pair
    tokens = vllm.to_tokens(PROMPT)
    g = torch.Generator().manual_seed(1)
    vector = torch.randn(vllm.d_model, generator=g)
    cases = [{"resid_pre.1": Add(vector, scale=2.0)}, {"attn_out.0": Scale(0.5, positions=[2, 3])},
             {"z.1": Zero(heads=[1])}, {"mlp_post.2": Set(torch.randn(vllm.d_mlp, generator=g), positions=-1)},
             {"resid_post.0": Add(vector, norm_relative=True, scale=0.5)}]
    if name != "gpt_neox":
        cases.append({"resid_mid.1": Add(vector)})
    for edits in cases:
        got = run_with_cache(vllm, tokens, ["logits", "resid_post.2"], edits=edits)
        want = run_with_cache(eager, tokens, ["logits", "resid_post.2"], edits=edits)
        for point in ("logits", "resid_post.2"):
            assert_near(got[point], want[point], f"{edits}: {point}")


def test_generation_matches_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens(PROMPT)
    got_completion, got = capture_generation(vllm, tokens, ["resid_post.1", "mlp_out.2"], max_tokens=5)
    want_completion, want = capture_generation(eager, tokens, ["resid_post.1", "mlp_out.2"], max_tokens=5)
    assert got_completion.token_ids == want_completion.token_ids
    for point in ("resid_post.1", "mlp_out.2"):
        assert_near(got[point], want[point], point)
