"""Edits that compose (issue 26): a list of edits on one address applies in order, a function
edit that returns None only reads, and batched activation patching (a Set / Add value with a
batch axis patches each row with its own value), on the eager backend. Each is checked against a
hand-written forward hook on the Hugging Face decoder layer (an oracle that shares no code with
the library's recorder); tests/vllm/test_tl_vllm.py and tests/cluster/replicas/test_tl_cluster.py check vLLM and a
cluster against the eager backend."""

from __future__ import annotations

import contextlib

import pytest
import torch

from interp_engine import Add, InputError, Scale, Set, Zero, run_with_cache

from ..devices import on

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


# -- batched activation patching --------------------------------------------------------------


def _rows_by_hand(model, tokens, writes):
    """The logits with ``writes(h)`` applied to resid_post.LAYER of the whole batch by hand."""
    return _oracle(model, tokens, writes)


def test_a_value_per_row_patches_each_row_with_its_own(model, tokens):
    at = f"resid_post.{LAYER}"
    g = torch.Generator().manual_seed(11)
    clean = on(model, torch.randn(tokens.shape[0], model.d_model, generator=g))
    got = run_with_cache(model, tokens, ["logits", at], edits={at: Set(clean, positions=[1])})

    def by_hand(h):
        h = h.clone()
        h[:, 1] = clean
        return h

    torch.testing.assert_close(got["logits"], _rows_by_hand(model, tokens, by_hand), rtol=0, atol=0)
    assert torch.equal(got[at][:, 1], clean)
    delta = on(model, torch.randn(tokens.shape[0], model.d_model, generator=g))
    added = run_with_cache(model, tokens, ["logits"], edits={at: Add(delta, scale=2.0)})["logits"]
    torch.testing.assert_close(added, _rows_by_hand(model, tokens, lambda h: h + 2.0 * delta[:, None]),
                               rtol=0, atol=0)


def test_a_value_per_row_and_position_follows_each_rows_own_positions(model, tokens):
    """positions=[0, -1] on a padded batch are different columns in each row; a [batch, 2, d]
    value puts row b's two values at its own first and last token."""
    at = f"resid_post.{LAYER}"
    lengths = (tokens >= 0).sum(1).tolist()
    value = on(model, torch.randn(tokens.shape[0], 2, model.d_model, generator=torch.Generator().manual_seed(12)))
    got = run_with_cache(model, tokens, ["logits"], edits={at: Set(value, positions=[0, -1])})["logits"]

    def by_hand(h):
        h = h.clone()
        for b, n in enumerate(lengths):
            h[b, 0], h[b, n - 1] = value[b, 0], value[b, 1]
        return h

    torch.testing.assert_close(got, _rows_by_hand(model, tokens, by_hand), rtol=0, atol=0)
    whole = on(model, torch.randn(*tokens.shape, model.d_model, generator=torch.Generator().manual_seed(13)))
    for edit, change in [(Set(whole), lambda h: whole.clone()), (Add(whole), lambda h: h + whole)]:
        got = run_with_cache(model, tokens, ["logits"], edits={at: edit})["logits"]
        torch.testing.assert_close(got, _rows_by_hand(model, tokens, change), rtol=0, atol=0)


def test_a_value_per_row_on_heads_and_in_generation(model, tokens):
    z = f"z.{LAYER}"
    per_head = on(model, torch.randn(tokens.shape[0], model.d_head, generator=torch.Generator().manual_seed(14)))
    # one position's block with heads=[1] is [1, d_head]: a value per row is [batch, 1, d_head]
    got = run_with_cache(model, tokens, ["logits", z], edits={z: Set(per_head[:, None], heads=[1], positions=[-1])})
    lengths = (tokens >= 0).sum(1).tolist()

    def by_hand(t, address):
        t = t.clone()
        for b, n in enumerate(lengths):
            t[b, n - 1, 1] = per_head[b]
        return t

    want = run_with_cache(model, tokens, ["logits", z], edits={z: by_hand})
    assert torch.equal(got["logits"], want["logits"]) and torch.equal(got[z], want[z])
    from interp_engine import capture_generation

    prompt = model.to_tokens("generate with a row's own vector")
    vector = on(model, torch.randn(model.d_model, generator=torch.Generator().manual_seed(15)))
    one, one_cache = capture_generation(model, prompt, ["logits"], max_tokens=4,
                                        edits={f"resid_post.{LAYER}": Add(vector[None], scale=9.0)})
    same, same_cache = capture_generation(model, prompt, ["logits"], max_tokens=4,
                                          edits={f"resid_post.{LAYER}": Add(vector, scale=9.0)})
    assert one.token_ids == same.token_ids and torch.equal(one_cache["logits"], same_cache["logits"])


def test_a_patching_sweep_in_one_batch_equals_one_patch_per_run(model):
    """The sweep batched patching is for: k copies of the corrupted prompt, row i patched at
    position i with the clean run's activation, equals k runs of one patch each (a different
    batch shape: within the same-backend tolerance)."""
    from ..oracles import REL_SAME, assert_near

    clean_tokens, corrupt = model.to_tokens("the sweep is clean"), model.to_tokens("the sweep is dirty")
    at = f"resid_pre.{LAYER}"
    clean = run_with_cache(model, clean_tokens, [at])[at][0]  # [pos, d]
    n = corrupt.shape[1]
    batch = corrupt.repeat(n, 1)
    delta = torch.zeros(n, n, model.d_model, device=clean.device)
    corrupt_act = run_with_cache(model, corrupt, [at])[at][0]
    for i in range(n):
        delta[i, i] = clean[i] - corrupt_act[i]
    swept = run_with_cache(model, batch, ["logits"], positions=-1, edits={at: Add(delta)})["logits"][:, 0]
    for i in range(n):
        one = run_with_cache(model, corrupt, ["logits"], positions=-1,
                             edits={at: Set(clean[i], positions=[i])})["logits"][0, 0]
        assert_near(swept[i], one, f"patch at position {i}", REL_SAME)


@pytest.mark.parametrize("edit, words", [
    (lambda m, t: Set(torch.zeros(t.shape[0] + 1, m.d_model), positions=[0]), "the batch has 2 rows"),
    (lambda m, t: Set(torch.zeros(t.shape[0], 3, m.d_model), positions=[0, 1]),
     "gives 3 values per row, but positions= picks 2 positions per row"),
    (lambda m, t: Set(torch.zeros(t.shape[0], 3, m.d_model)), "with positions=None it edits all"),
    (lambda m, t: Add(torch.zeros(t.shape[0], m.d_model) + 1, norm_relative=True), "norm_relative=True takes one"),
    (lambda m, t: Set(torch.zeros(1, 1, t.shape[0], m.d_model)), "has 3 axes before one position's block"),
    (lambda m, t: Set(torch.zeros(t.shape[0], m.d_model + 1)), r"does not end in one position.s block \[128\]"),
])
def test_bad_per_row_values_are_clear_errors(model, tokens, edit, words):
    with pytest.raises(InputError, match=words):
        run_with_cache(model, tokens, ["logits"], edits={f"resid_post.{LAYER}": edit(model, tokens)})
    from interp_engine import capture_generation

    with pytest.raises(InputError, match="a value per position covers prompt positions only"):
        capture_generation(model, model.to_tokens("x y"), ["logits"], max_tokens=2,
                           edits={"resid_post.0": Set(torch.zeros(1, 1, model.d_model), positions="generated")})
