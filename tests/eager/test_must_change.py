"""Every family feature of the tiny models is observable: the eager capture equals HF's own eager
model, and the same oracle with that one feature turned off (a config override) differs from it by
far more than the cross-backend tolerance. A feature the fixtures leave invisible (a softcap the
scores never reach, a window longer than the prompts, a scalar equal to the default) cannot be
checked by any comparison, on either backend; this module fails when one becomes invisible."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from interp_engine import run_with_cache
from interp_engine.compare import CROSS_BACKEND, SAME_BACKEND, relative_error

from ..devices import on

#: longer than the sliding windows (8 tokens) of the tiny Mistral and Gemma 2
PROMPT = "The quick brown fox jumps over the lazy dog"
#: how far turning a feature off must move the result: a hundred times the loosest tolerance
MUST_CHANGE = 100 * CROSS_BACKEND
POINTS = ["resid_post.2", "logits"]

#: (family, feature) -> the config override that turns it off
FEATURES = {
    ("gemma2", "attention softcapping"): {"attn_logit_softcapping": None},
    ("gemma2", "final logit softcapping"): {"final_logit_softcapping": None},
    ("gemma2", "query_pre_attn_scalar"): {"query_pre_attn_scalar": 64},  # = head_dim: the default scaling
    ("gemma2", "sliding window"): {"layer_types": ["full_attention"] * 3},
    ("mistral", "sliding window"): {"sliding_window": None},
}


def _hf(path, model, **overrides):
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **overrides)
    return hf.to(model.device).eval()


def _outputs(hf, model, tokens) -> dict:
    with torch.no_grad():
        out = hf(input_ids=on(model, tokens), output_hidden_states=True)
    return {"resid_post.2": out.hidden_states[2 + 1], "logits": out.logits}


@pytest.fixture(scope="module")
def captures(eager_models):
    """family -> (model, tokens, capture)"""
    done = {}

    def get(family):
        if family not in done:
            model = eager_models(family)
            tokens = model.to_tokens(PROMPT)
            done[family] = model, tokens, run_with_cache(model, tokens, POINTS)
        return done[family]

    return get


@pytest.mark.parametrize("family,feature", sorted(FEATURES), ids=lambda x: str(x).replace(" ", "_"))
def test_feature_is_applied_and_observable(captures, tiny_path, family, feature):
    model, tokens, cache = captures(family)
    assert tokens.shape[1] > 8
    path = tiny_path(family)
    want = _outputs(_hf(path, model), model, tokens)
    off = _outputs(_hf(path, model, **FEATURES[family, feature]), model, tokens)
    final = model.final_norm(cache.get("resid_post", 2))  # HF's last hidden state has the final norm
    got = {"resid_post.2": final, "logits": cache["logits"]}
    moved = max(relative_error(off[p], want[p]) for p in POINTS)
    assert moved > MUST_CHANGE, f"{family} without its {feature} moves the outputs by only {moved:.3g}"
    for point in POINTS:
        err = relative_error(got[point], want[point])
        assert err <= SAME_BACKEND, f"{family} {point}: {err:.3g} from HF's eager model (its {feature} dropped?)"
