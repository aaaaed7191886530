"""The generic path (interp_engine/archs/generic.py) on families no record names: StableLM (a
sequential block, grouped-query attention), Phi (a parallel block), StarCoder2, GPT-BigCode
(multi-query attention, learned positions) and OLMo (weightless norms), built from their configs.

Oracles: Hugging Face's ``output_hidden_states`` and logits for the residual stream and ``logits``
(1e-5 relative), the output and down projections' weights applied by hand for ``z`` / ``mlp_post``,
and the block identities. What the probe cannot prove is refused with the reason, and a known
family always takes its record.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from interp_engine import (Add, AddressError, UnsupportedModel, head_contributions, load_model, logit_lens,
                           run_with_cache)
from interp_engine.archs import record_for_model

from .. import tiny, tiny_gpt
from ..oracles import REL_SAME, assert_near

PROMPT = "a family with no record"
SERVED = {"resid_pre", "attn_out", "attn_out_post", "mlp_out", "mlp_out_post", "resid_post", "z", "mlp_post", "resid_streams",
          "embeddings", "lm_head",
          "final_norm", "logits"}
#: name -> (module paths the generic path must find, whether the block is sequential)
FAMILIES = {"stablelm": ("self_attn.o_proj", "mlp.down_proj", True), "phi": ("self_attn.dense", "mlp.fc2", False),
            "starcoder2": ("self_attn.o_proj", "mlp.c_proj", True), "gpt_bigcode": ("attn.c_proj", "mlp.c_proj", True),
            "olmo": ("self_attn.o_proj", "mlp.down_proj", True)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def name(request):
    return request.param


@pytest.fixture(scope="module")
def pair(name, tiny_root):
    path = tiny_gpt.build(name, tiny_root)
    return load_model(str(path), backend="eager"), AutoModelForCausalLM.from_pretrained(path).eval()


def test_the_generic_path_serves_what_it_proved(name, pair):
    model, _ = pair
    z_path, down_path, sequential = FAMILIES[name]
    assert model.arch.generic and model.info.family == f"generic ({name})"
    assert {a.name for a in model.points()} == SERVED | ({"resid_mid"} if sequential else set())
    assert (model.arch.sites["z"].module, model.arch.sites["mlp_post"].module) == (z_path, down_path)
    with pytest.raises(AddressError, match="the generic path serves no q, k, v or pattern"):
        run_with_cache(model, model.to_tokens(PROMPT), ["q.0"])
    if not sequential:
        with pytest.raises(AddressError, match="a parallel block"):
            run_with_cache(model, model.to_tokens(PROMPT), ["resid_mid.1"])


def test_the_path_taken_is_logged_in_one_line(name, tiny_root, caplog):
    with caplog.at_level(logging.INFO, logger="interp_engine"):
        load_model(str(tiny_gpt.build(name, tiny_root)), backend="eager")
    lines = [r.getMessage() for r in caplog.records if r.name == "interp_engine"]
    assert len(lines) == 1 and f"no family record for model_type {name!r}: the generic path serves" in lines[0]


def test_residuals_and_logits_equal_hugging_faces(pair):
    model, hf = pair
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, ["resid_pre", "resid_post", "logits"])
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
    n = model.n_layers
    for L in range(n):
        assert_near(cache.get("resid_pre", L), out.hidden_states[L], f"resid_pre.{L}", REL_SAME)
    for L in range(n - 1):
        assert_near(cache.get("resid_post", L), out.hidden_states[L + 1], f"resid_post.{L}", REL_SAME)
    assert_near(model.final_norm(cache.get("resid_post", n - 1)), out.hidden_states[n], "final norm", REL_SAME)
    assert_near(cache["logits"], out.logits, "logits", REL_SAME)
    assert_near(logit_lens(model, cache, layers=[n - 1])[0], out.logits, "lens", REL_SAME)


def test_the_sites_mean_what_they_mean(name, pair):
    """z and mlp_post through the weights of their projections give attn_out and mlp_out; the three
    block outputs add up to resid_post (and resid_pre + attn_out is resid_mid where it exists)."""
    model, hf = pair
    z_path, down_path, sequential = FAMILIES[name]
    sites = ["resid_pre", "attn_out", "mlp_out", "resid_post", "z", "mlp_post"] + (["resid_mid"] if sequential else [])
    cache = run_with_cache(model, model.to_tokens(PROMPT), sites)
    for L in range(model.n_layers):
        layer = model.hf.get_submodule(model.arch.layers)[L]
        o_proj, down = layer.get_submodule(z_path), layer.get_submodule(down_path)
        c = {s: cache.get(s, L) for s in sites}
        assert_near(F.linear(c["z"].flatten(-2), o_proj.weight, o_proj.bias), c["attn_out"], f"z.{L}", REL_SAME)
        assert_near(F.linear(c["mlp_post"], down.weight, down.bias), c["mlp_out"], f"mlp_post.{L}", REL_SAME)
        assert_near(c["resid_pre"] + c["attn_out"] + c["mlp_out"], c["resid_post"], f"block {L}", REL_SAME)
        assert_near(head_contributions(model, cache, L).sum(2) + (o_proj.bias if o_proj.bias is not None else 0),
                    c["attn_out"], f"heads {L}", REL_SAME)
        if sequential:
            assert_near(c["resid_pre"] + c["attn_out"], c["resid_mid"], f"resid_mid.{L}", REL_SAME)


def test_edits_and_positions(pair):
    model, hf = pair
    tokens = model.to_tokens(PROMPT)
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(5))
    got = run_with_cache(model, tokens, ["logits"], edits={"resid_post.0": Add(vector, positions=[2])})["logits"]

    def add(module, args, out):
        hidden = (out[0] if isinstance(out, tuple) else out).clone()
        hidden[:, 2] += vector
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    handle = hf.get_submodule(model.arch.layers)[0].register_forward_hook(add)
    try:
        with torch.no_grad():
            want = hf(tokens).logits
    finally:
        handle.remove()
    assert_near(got, want, "resid_post.0 edit", REL_SAME)
    full = run_with_cache(model, tokens, ["mlp_out.2"])
    last = run_with_cache(model, tokens, ["mlp_out.2"], positions=-1)
    assert_near(last["mlp_out.2"][:, 0], full["mlp_out.2"][:, -1], "positions=-1", REL_SAME)


def test_a_known_family_always_takes_its_record(tiny_path):
    """The tiny Llama would pass every proof of the generic path, but its record wins."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_path("llama"))
    assert record_for_model(hf).family == "llama" and not record_for_model(hf).generic


def test_a_layout_it_cannot_prove_is_refused(tiny_root):
    """Cohere multiplies its logits by ``logit_scale``: unembed(final_norm(x)) is not its logits,
    so no final norm can be proven and the model is refused, naming what is missing."""
    import transformers as t

    config = t.CohereConfig(vocab_size=tiny.VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=256, logit_scale=0.5)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModel, match="no final norm among .* gives the model's logits"):
        record_for_model(hf)


def test_vllm_refuses_the_generic_path_before_starting_an_engine(tiny_root):
    pytest.importorskip("vllm")
    with pytest.raises(UnsupportedModel, match="runs on backend='eager' only"):
        load_model(str(tiny_gpt.build("stablelm", tiny_root)), backend="vllm")


def test_a_dataset_job_preflight_leaves_a_generic_models_points_to_its_replicas(tiny_root, tmp_path):
    """Only a loaded model can prove what the generic path serves: the driver's preflight checks the
    rest of the job and does not refuse the model_type; a known family's points are still checked."""
    from interp_engine.errors import ConfigError
    from interp_engine.jobs.config import BuildConfig
    from interp_engine.jobs.preflight import preflight

    path = str(tiny_gpt.build("stablelm", tiny_root))
    preflight(BuildConfig(model=path, prompts=["hello"], points=["mlp_post.1"], output=str(tmp_path / "a")))
    gpt2 = str(tiny_gpt.build("gpt2", tiny_root))
    with pytest.raises(ConfigError, match="points: .*layer 9 is out of range"):
        preflight(BuildConfig(model=gpt2, prompts=["hello"], points=["resid_post.9"], output=str(tmp_path / "b")))
