"""TransformerLens hook names and negative layers as addresses (issue 26, items 1-3), on the
eager backend; tests/vllm/test_tl_vllm.py and tests/cluster/replicas/test_tl_cluster.py check the same on vLLM and a
cluster. The TL names below are written out as TransformerLens spells them, not read from the
library's table, so a wrong entry there fails here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from interp_engine import (Add, Address, AddressError, AnalysisError, Cache, Zero, accumulated_resid, decompose_resid,
                           format_address, head_contributions, lens_top, logit_lens, parse_address, run_with_cache,
                           stack)
from interp_engine.dataset.export import tl_hook_name

#: TransformerLens's own spelling -> our address
SPELLED = {
    "blocks.10.hook_resid_post": Address("resid_post", 10),
    "blocks.0.hook_resid_pre": Address("resid_pre", 0),
    "blocks.4.hook_resid_mid": Address("resid_mid", 4),
    "blocks.1.hook_attn_out": Address("attn_out_post", 1),  # the residual contribution, after any post-norm
    "blocks.1.hook_mlp_out": Address("mlp_out_post", 1),
    "blocks.1.attn.hook_out": Address("attn_out", 1),  # the bridge's raw block outputs
    "blocks.1.mlp.hook_out": Address("mlp_out", 1),
    "blocks.7.attn.hook_z": Address("z", 7),
    "blocks.5.attn.hook_rot_q": Address("q", 5),
    "blocks.5.attn.hook_rot_k": Address("k", 5),
    "blocks.5.attn.hook_v": Address("v", 5),
    "blocks.2.attn.hook_pattern": Address("pattern", 2),
    "blocks.3.mlp.hook_post": Address("mlp_post", 3),
    "blocks.6.mlp.hook_expert_weights": Address("expert_weights", 6),
    "blocks.6.mlp.hook_expert_indices": Address("expert_indices", 6),
    "ln_final.hook_normalized": Address("ln_final_normalized"),  # before the final norm's gain
    "ln_final.hook_out": Address("final_norm"),  # after it: what the unembedding reads
    "blocks.1.ln1.hook_normalized": Address("ln1_normalized", 1),
    "blocks.1.ln2.hook_normalized": Address("ln2_normalized", 1),
    "blocks.1.attn.hook_in": Address("attn_in", 1),
    "blocks.1.mlp.hook_in": Address("mlp_in", 1),
    "blocks.1.mlp.hook_pre": Address("mlp_pre", 1),
    "blocks.1.mlp.hook_pre_linear": Address("mlp_pre_linear", 1),
}


@pytest.mark.parametrize("name", list(SPELLED))
def test_a_tl_name_reads_as_our_address_and_back(name):
    address = SPELLED[name]
    assert parse_address(name) == address
    assert format_address(address, style="tl") == name
    assert parse_address(format_address(address)) == address  # our own form still round-trips


@pytest.mark.parametrize("name, closest", [
    ("hook_embed", "'embeddings'.*Gemma"),
    ("blocks.1.hook_mlp_in", r"'resid_mid.1'.*mlp_in.1"),
    ("blocks.3.attn.hook_q", r"'q.3': q.3 is the queries after qk-norm and rotary .*hook_rot_q"),
    ("blocks.3.attn.hook_k", "'k.3'"),
    ("blocks.2.attn.hook_attn_scores", "'attn_scores.2'.*-inf"),
    ("blocks.2.attn.hook_result", r"'z.2'.*head_contributions\(model, cache, 2\)"),
    ("blocks.3.hook_resid_psot", r"Did you mean 'blocks.3.hook_resid_post' \(here 'resid_post.3'\)"),
    ("blocks.3.ln1.hook_normalised", r"Did you mean 'blocks.3.ln1.hook_normalized' \(here 'ln1_normalized.3'\)"),
    ("blocks.3.ln1.hook_scale", r"'resid_pre.3'.*scale is not a point"),
])
def test_a_tl_name_without_an_equivalent_names_the_closest(name, closest):
    with pytest.raises(AddressError, match=closest):
        parse_address(name)


def test_points_without_a_tl_name_say_so():
    with pytest.raises(AddressError, match="'logits' has no TransformerLens hook name; these do: resid_pre"):
        format_address(Address("logits"), style="tl")
    with pytest.raises(AddressError, match="style must be 'ours'.*or 'tl'"):
        format_address(Address("z", 1), style="transformer_lens")


def test_the_saelens_export_names_its_column_from_the_same_table():
    for name, address in SPELLED.items():
        if address.name not in ("pattern", "expert_weights", "expert_indices", "final_norm", "ln_final_normalized"):
            assert tl_hook_name(str(address)) == name


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(["a tl name", "and a longer second prompt"])


def test_tl_names_capture_look_up_and_edit_as_ours(model, tokens):
    """The same call with TL names returns the same tensors under our addresses (the same
    computation: bit for bit), answers lookups by either name, and edits keyed by TL names equal
    edits keyed by ours."""
    ours = ["resid_post.1", "z.0", "mlp_post.2", "resid_pre.0", "attn_out_post.1", "pattern.1"]
    theirs = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_z", "blocks.2.mlp.hook_post",
              "blocks.0.hook_resid_pre", "blocks.1.hook_attn_out", "blocks.1.attn.hook_pattern"]
    want = run_with_cache(model, tokens, ours)
    got = run_with_cache(model, tokens, theirs)
    assert list(got) == [parse_address(p) for p in ours]
    for name, point in zip(theirs, ours):
        assert torch.equal(got[name], want[point])
        assert got[name] is got[point]
        assert name in got
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(1))
    edited = run_with_cache(model, tokens, ["logits"], edits={"blocks.0.hook_resid_post": Add(vector, scale=4.0),
                                                              "blocks.1.attn.hook_z": Zero(heads=[0])})
    same = run_with_cache(model, tokens, ["logits"], edits={"resid_post.0": Add(vector, scale=4.0),
                                                            "z.1": Zero(heads=[0])})
    plain = run_with_cache(model, tokens, ["logits"])
    assert torch.equal(edited["logits"], same["logits"])
    assert not torch.equal(edited["logits"], plain["logits"])


def test_negative_layers_count_from_the_end(model, tokens, tmp_path):
    n = model.n_layers
    cache = run_with_cache(model, tokens, ["resid_post.-1", Address("z", -2), ("mlp_out", -n),
                                           "blocks.-1.hook_resid_pre", "resid_post.0"])
    real = [Address("resid_post", n - 1), Address("z", n - 2), Address("mlp_out", 0), Address("resid_pre", n - 1),
            Address("resid_post", 0)]
    assert list(cache) == real  # the cache holds real layer numbers
    want = run_with_cache(model, tokens, real)
    for address in real:
        assert torch.equal(cache[address], want[address])
    assert cache["resid_post", -1] is cache[Address("resid_post", n - 1)] is cache["resid_post.-1"]
    assert cache.get("z", -2) is cache["z", n - 2]
    assert ("resid_post", -1) in cache and ("resid_post", -2) not in cache
    cache.save(tmp_path / "c.safetensors")
    assert torch.equal(Cache.load(tmp_path / "c.safetensors")["resid_post", -1], cache["resid_post", n - 1])
    assert run_with_cache(model, tokens, ["resid_post"]).select(-1)["resid_post", -1].shape[1] == 1
    with pytest.raises(KeyError, match="does not know its model's layer count"):
        Cache({"resid_post.1": cache["resid_post", n - 1]}, tokens)["resid_post", -1]

    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(2))
    edited = run_with_cache(model, tokens, ["logits"], edits={"resid_post.-2": Add(vector, scale=3.0)})
    same = run_with_cache(model, tokens, ["logits"], edits={f"resid_post.{n - 2}": Add(vector, scale=3.0)})
    assert torch.equal(edited["logits"], same["logits"])
    with pytest.raises(AddressError, match=rf"layer -{n + 1} is out of range.*-{n} is layer 0"):
        run_with_cache(model, tokens, [f"resid_post.-{n + 1}"])


def test_analysis_takes_negative_layers_and_an_int(model, tokens):
    n = model.n_layers
    cache = run_with_cache(model, tokens, ["resid_pre.0", "resid_post", "attn_out_post", "mlp_out_post", "z"])
    assert torch.equal(logit_lens(model, cache, [-1]), logit_lens(model, cache, [n - 1]))
    assert torch.equal(logit_lens(model, cache, -1), logit_lens(model, cache, [n - 1]))  # an int is one layer
    assert torch.equal(logit_lens(model, cache, 1), logit_lens(model, cache, [1]))
    top = lens_top(model, cache, -1)
    assert top.layers == [n - 1] and torch.equal(top.ids, lens_top(model, cache, [n - 1]).ids)
    assert torch.equal(stack(cache, "resid_post", [-1, 0]), stack(cache, "resid_post", [n - 1, 0]))
    assert stack(cache, "resid_post", -1).shape[0] == 1
    assert torch.equal(head_contributions(model, cache, -1), head_contributions(model, cache, n - 1))
    assert torch.equal(accumulated_resid(cache, -1), accumulated_resid(cache))  # -1 = the final resid_post
    assert torch.equal(decompose_resid(cache, -2), decompose_resid(cache, n - 1))
    with pytest.raises(AnalysisError, match="layers takes layer numbers, got the string '20'"):
        stack(cache, "resid_post", "20")
    with pytest.raises(AnalysisError, match=r"site must be the name of a per-layer site.*got 'resid_post.1' "
                                            r"\(the layer goes in layers="):
        stack(cache, "resid_post.1")
    with pytest.raises(AnalysisError, match=r"layer=-4 is out of range: layers are 0\.\.2"):
        logit_lens(model, cache, -4)


def test_cfg_tokenizer_and_d_vocab_as_transformer_lens_names_them(model):
    config = model.hf.config  # the oracle: the Hugging Face config, read by hand
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab, cfg.n_ctx,
            cfg.n_key_value_heads) == (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                       config.head_dim, config.intermediate_size, config.vocab_size,
                                       config.max_position_embeddings, config.num_key_value_heads)
    assert cfg.dtype == torch.float32 and cfg.num_experts is None and model.d_vocab == config.vocab_size
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 1
    assert model.tokenizer("a b c")["input_ids"] == model.to_tokens("a b c")[0].tolist()


def test_final_norm_is_what_the_unembedding_reads(model, tokens):
    """final_norm equals Hugging Face's last hidden state (after the model's norm), and the
    unembedding of it is the logits; asked with an early layer, the forward still runs whole."""
    cache = run_with_cache(model, tokens, ["ln_final.hook_out", "resid_post.0", "logits", "resid_post.-1"])
    real = tokens >= 0
    with torch.no_grad():
        hidden = model.hf(input_ids=tokens.clamp(min=0), attention_mask=real, output_hidden_states=True).hidden_states
    torch.testing.assert_close(cache["final_norm"][real], hidden[-1][real], rtol=1e-6, atol=1e-6)
    assert torch.equal(cache["final_norm"][~real], torch.zeros_like(cache["final_norm"][~real]))
    assert torch.equal(model.unembed(cache["final_norm"])[real], cache["logits"][real])
    assert torch.equal(model.final_norm(cache["resid_post", -1])[real], cache["final_norm"][real])
    alone = run_with_cache(model, tokens, ["final_norm", "resid_post.0"], positions=-1)
    assert torch.equal(alone["final_norm"][:, 0], torch.stack([cache["final_norm"][b, int(n) - 1]
                                                                for b, n in enumerate(real.sum(1))]))
