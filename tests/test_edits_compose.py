"""Edits that compose (issue 26): a list of edits on one address applies in order, a function
edit that returns None only reads, and batched activation patching (a Set / Add value with a
batch axis patches each row with its own value), on the eager backend. Each is checked against a
hand-written forward hook on the Hugging Face decoder layer (an oracle that shares no code with
the library's recorder); tests/test_tl_vllm.py and tests/test_tl_cluster.py check vLLM and a
cluster against the eager backend."""

from __future__ import annotations

import contextlib

import pytest
import torch

from interp_engine import Add, InputError, Scale, Set, Zero, run_with_cache

from .devices import on

LAYER = 1


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(["compose these edits", "and these too, on a longer row"])


@contextlib.contextmanager
def layer_output(model, change):
    """``change(hidden [b, p, d]) -> hidden`` on the output of decoder layer LAYER (resid_post),
    written by hand on the HF module."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (change(output[0]), *output[1:])
        return change(output)

    handle = model.hf.model.layers[LAYER].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _oracle(model, tokens, change):
    with layer_output(model, change):
        return run_with_cache(model, tokens, ["logits"])["logits"]


def test_a_list_of_edits_applies_in_order(model, tokens):
    vector = on(model, torch.randn(model.d_model, generator=torch.Generator().manual_seed(3)))
    at = f"resid_post.{LAYER}"

    def add_then_zero_first(h):
        h = h + 2.0 * vector
        h = h.clone()
        h[:, 0] = 0
        return h

    got = run_with_cache(model, tokens, ["logits", at], edits={at: [Add(vector, scale=2.0), Zero(positions=[0])]})
    want = _oracle(model, tokens, add_then_zero_first)
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=0)
    assert torch.equal(got[at][:, 0], torch.zeros_like(got[at][:, 0]))  # the capture reads the last edit's output

    one_way = run_with_cache(model, tokens, ["logits"], edits={at: [Add(vector), Scale(0.5)]})["logits"]
    other_way = run_with_cache(model, tokens, ["logits"], edits={at: [Scale(0.5), Add(vector)]})["logits"]
    torch.testing.assert_close(one_way, _oracle(model, tokens, lambda h: (h + vector) * 0.5), rtol=0, atol=0)
    torch.testing.assert_close(other_way, _oracle(model, tokens, lambda h: h * 0.5 + vector), rtol=0, atol=0)
    assert not torch.equal(one_way, other_way)
    single = run_with_cache(model, tokens, ["logits"], edits={at: [Scale(0.5)]})["logits"]
    assert torch.equal(single, run_with_cache(model, tokens, ["logits"], edits={at: Scale(0.5)})["logits"])


def test_a_list_on_a_per_head_site(model, tokens):
    """A list of z edits with heads= equals the same composition written as one function edit."""
    z = f"z.{LAYER}"
    chained = run_with_cache(model, tokens, ["logits", z], edits={z: [Scale(3.0, heads=[1]), Zero(heads=[0])]})
    def by_hand(t, address):
        t = t.clone()
        t[:, :, 1] *= 3.0
        t[:, :, 0] = 0
        return t
    want = run_with_cache(model, tokens, ["logits", z], edits={z: by_hand})
    assert torch.equal(chained["logits"], want["logits"]) and torch.equal(chained[z], want[z])


def test_two_keys_for_one_address_and_an_empty_list_are_refused(model, tokens):
    n = model.n_layers
    with pytest.raises(InputError, match=rf"'resid_post.-1' and 'resid_post.{n - 1}' both name resid_post.{n - 1}: "
                                         rf"give it one key, with a list"):
        run_with_cache(model, tokens, ["logits"], edits={"resid_post.-1": Zero(), f"resid_post.{n - 1}": Scale(2.0)})
    with pytest.raises(InputError, match="the list is empty"):
        run_with_cache(model, tokens, ["logits"], edits={"resid_post.0": []})


def test_a_function_edit_that_returns_none_only_reads(model, tokens):
    seen = []
    at = f"mlp_out.{LAYER}"
    got = run_with_cache(model, tokens, ["logits", at], edits={at: lambda t, a: seen.append(t.clone())})
    plain = run_with_cache(model, tokens, ["logits", at])
    assert torch.equal(got["logits"], plain["logits"]) and torch.equal(got[at], plain[at])
    real = tokens >= 0
    assert len(seen) == 1 and torch.equal(seen[0][real], plain[at][real])
