"""Names and inputs from decoderesearch's interp-engine (issue 37): its exact synonyms read as our
points, its names for tensors we serve differently or not at all are refused with the closest point
and why, every unknown name gets a "did you mean", its ``resid_post.L.stream-S`` form reads as our
``resid_streams.L.S``, and token ids come as a ``list[int]`` or a 1-D tensor."""

import pytest
import torch

from interp_engine import Address, AddressError, parse_address, run_with_cache


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


def test_the_peers_exact_synonyms_are_our_points(model):
    assert parse_address("attn_probs.1") == Address("attn_probs", 1) == Address("pattern", 1)
    assert parse_address("mlp_act.2") == Address("mlp_post", 2)
    tokens = model.to_tokens("synonyms")
    got = run_with_cache(model, tokens, ["attn_probs.1", "mlp_act"])
    want = run_with_cache(model, tokens, ["pattern.1", "mlp_post"])
    assert list(got) == list(want)
    for address in want:
        assert torch.equal(got[address], want[address])
    assert model.points("attn_probs") == model.points("pattern")


@pytest.mark.parametrize("name, words", [
    ("value.1", r"closest is 'v'.*\[b, p, n_kv_heads \* d_head\].*v.L.flatten\(-2\)"),
    ("attn_gate.1", r"closest is 'z'.*after the gate"),
    ("q_norm_out.1", r"has no 'q_norm_out' \(this family has no qk-norm"),
    ("attn_stream_mix.1", r"closest is 'resid_streams'"),
    ("resid_psot.1", r"unknown site 'resid_psot' \(did you mean 'resid_post'\?\); known sites: resid_pre"),
    ("mlp_acts.1", r"did you mean 'mlp_act'\?"),
    ("attn_score.1", r"did you mean 'attn_scores'\?"),
    ("valeu.1", r"did you mean 'value'\? 'value' is decoderesearch interp-engine's name"),
    ("ln2_normalised.1", r"did you mean 'ln2_normalized'\?"),
    ("resid_mid.1.stream-2", r"resid_streams.1.2"),
    ("resid_pre.0.stream-1", r"entering layer 0.*resid_streams.0.1"),
    ("resid_post.1.stream-x", r"the stream form is name.layer.stream-S"),
])
def test_names_we_do_not_serve_say_what_to_use(model, name, words):
    with pytest.raises(AddressError, match=words):
        run_with_cache(model, model.to_tokens("a"), [name])


def test_the_peers_stream_form(model):
    assert parse_address("resid_post.1.stream-0") == Address("resid_streams", 1, 0)
    assert parse_address("resid_pre.2.stream-3") == Address("resid_streams", 1, 3)
    tokens = model.to_tokens("streams")
    cache = run_with_cache(model, tokens, ["resid_post.1.stream-0", "resid_post.1"])
    assert torch.equal(cache["resid_streams.1.0"], cache["resid_post.1"])


def test_token_ids_as_a_list_or_a_1d_tensor(model):
    tokens = model.to_tokens("The quick brown fox")
    want = run_with_cache(model, tokens, ["resid_post.1", "logits"])
    for given in (tokens[0].tolist(), tokens[0], tuple(tokens[0].tolist())):
        got = run_with_cache(model, given, ["resid_post.1", "logits"])
        assert torch.equal(got.tokens, tokens)
        assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["resid_post.1"], want["resid_post.1"])
    batch = model.tok.to_tokens(["The quick brown fox", "jumps"])
    rows = [row[row >= 0].tolist() for row in batch]
    got = run_with_cache(model, rows, ["resid_post.1"])
    assert torch.equal(got.tokens, batch)
    assert torch.equal(got["resid_post.1"], run_with_cache(model, batch, ["resid_post.1"])["resid_post.1"])
