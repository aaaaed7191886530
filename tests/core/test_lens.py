"""The logit lens on every dense family: the last layer reproduces HF's logits (Gemma 2's final
softcapping included), earlier layers equal HF's hidden states through the final norm and the
unembedding, padding reads as zeros, and a cache without resid_post is a clear error."""

import pytest
import torch

from interp_engine import Address, lens_top, logit_lens, run_with_cache

from ..tiny import DENSE_FAMILIES
from ..devices import on

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def model(request, eager_models):
    return eager_models(request.param)


def hf_reference(model, tokens):
    with torch.no_grad():
        out = model.hf(input_ids=on(model, tokens), output_hidden_states=True)
    return out.logits, out.hidden_states


def test_lens_matches_hf(model):
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, [Address("resid_post", L) for L in range(model.n_layers)])
    lens = logit_lens(model, cache)
    assert lens.shape == (model.n_layers, 1, tokens.shape[1], model.info.d_vocab)
    logits, hidden = hf_reference(model, tokens)
    torch.testing.assert_close(lens[-1], logits, atol=1e-5, rtol=1e-5)
    cap = getattr(model.hf.config, "final_logit_softcapping", None)
    with torch.no_grad():
        for L in range(model.n_layers - 1):
            expected = model.hf.lm_head(model.hf.model.norm(hidden[L + 1]))
            if cap:
                expected = torch.tanh(expected / cap) * cap
            torch.testing.assert_close(lens[L], expected, atol=1e-5, rtol=1e-5)


def test_lens_top_and_layers(model):
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, ["resid_post.0", "resid_post.2"])
    top = lens_top(model, cache)
    assert top.layers == [0, 2]
    assert top.ids.shape == top.probs.shape == (2, 1, tokens.shape[1])
    full = logit_lens(model, cache, [2])[0]
    assert torch.equal(top.ids[1], full.argmax(-1).cpu())  # the top tokens come back on the CPU
    torch.testing.assert_close(top.probs[1], full.softmax(-1).max(-1).values.cpu())


def test_lens_padding_is_zero(model):
    tokens = model.tok.to_tokens(["ab", "a longer prompt"])
    cache = run_with_cache(model, tokens, ["resid_post.1"])
    lens = logit_lens(model, cache)[0]
    assert bool((lens[~cache.mask] == 0).all())
    alone = logit_lens(model, run_with_cache(model, model.to_tokens("ab"), ["resid_post.1"]))[0, 0]
    torch.testing.assert_close(lens[0, : alone.shape[0]], alone, atol=1e-4, rtol=1e-4)


def test_lens_errors(model):
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["mlp_out.1", "resid_post.0"])
    with pytest.raises(KeyError, match="resid_post at layers \\[1\\]"):
        logit_lens(model, cache, [1])
    empty = run_with_cache(model, model.to_tokens(PROMPT), ["mlp_out.1"])
    with pytest.raises(KeyError, match="Capture them first"):
        logit_lens(model, empty)
    with pytest.raises(TypeError, match="object has no final_norm or unembed: pass the model that load_model"):
        logit_lens(object(), cache)
