"""A family record (:class:`interp_engine.archs.Arch`) holds all that is known per family: module
paths, softcapping, how projection weights are stored, and a config test where ``model_type``
alone does not decide. These tests check the record's rules on real modules and configs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.pytorch_utils import Conv1D

from interp_engine.archs import FAMILIES, Arch, arch_for
from interp_engine.archs.dense import LLAMA_SITES


def test_in_out_weights_read_as_linear():
    """GPT-2's Conv1D stores ``[in, out]``; the record turns it into what nn.Linear holds, so a
    reader that multiplies as nn.Linear does computes the module's own output."""
    torch.manual_seed(0)
    conv = Conv1D(nf=6, nx=4)  # 4 in, 6 out; weight [4, 6]
    record = Arch("gpt2ish", ("gpt2ish",), LLAMA_SITES, weights="in_out")
    x = torch.randn(3, 4)
    weight = record.linear_weight(conv.weight)
    assert weight.shape == (6, 4)
    torch.testing.assert_close(torch.nn.functional.linear(x, weight, conv.bias), conv(x), rtol=1e-6, atol=1e-6)
    linear = torch.nn.Linear(4, 6)
    assert Arch("l", ("l",), LLAMA_SITES).linear_weight(linear.weight) is linear.weight
    with pytest.raises(ValueError, match="'out_in' or 'in_out'"):
        Arch("bad", ("bad",), LLAMA_SITES, weights="columns")


def test_a_config_test_picks_the_record_where_model_type_does_not():
    parallel = Arch("neox-parallel", ("gpt_neox",), LLAMA_SITES, matches=lambda c: c.use_parallel_residual)
    sequential = Arch("neox-sequential", ("gpt_neox",), LLAMA_SITES, matches=lambda c: not c.use_parallel_residual)
    families = (parallel, sequential)
    assert arch_for(AutoConfig.for_model("gpt_neox", use_parallel_residual=True), families) is parallel
    assert arch_for(AutoConfig.for_model("gpt_neox", use_parallel_residual=False), families) is sequential
    with pytest.raises(ValueError, match="fits none of its family records"):
        arch_for(AutoConfig.for_model("gpt_neox", use_parallel_residual=True), (sequential,))
    with pytest.raises(ValueError, match="not supported yet; supported: "):
        arch_for(AutoConfig.for_model("bert"))


def test_softcapping_comes_from_the_record():
    gemma = AutoConfig.for_model("gemma2", final_logit_softcapping=30.0)
    assert arch_for(gemma).softcap(gemma) == 30.0
    llama = AutoConfig.for_model("llama")
    llama.final_logit_softcapping = 30.0  # a stray attribute on a family without softcapping is not read
    assert arch_for(llama).softcap(llama) is None


def test_every_record_is_well_formed():
    for arch in FAMILIES:
        assert arch.weights in ("out_in", "in_out") and arch.layers and arch.final_norm and arch.embed
        assert set(arch.vllm) <= set(arch.sites) | {"logits", "router_logits", "expert_weights", "expert_indices"}


def test_sizes_come_from_each_familys_config_names():
    """d_mlp, d_head and n_kv_heads are read under the names each family's config uses."""
    from interp_engine.archs import model_info

    gpt2 = AutoConfig.for_model("gpt2", n_embd=256, n_head=4, n_layer=2)
    assert (model_info(gpt2, "g").d_mlp, model_info(gpt2, "g").d_head, model_info(gpt2, "g").n_kv_heads) == (1024, 64, 4)
    gpt2.n_inner = 300
    assert model_info(gpt2, "g").d_mlp == 300
    neox = AutoConfig.for_model("gpt_neox", hidden_size=256, num_attention_heads=4, intermediate_size=640)
    neox.head_dim = 32  # not a GPT-NeoX name: its attention always uses hidden_size / heads
    assert (model_info(neox, "n").d_mlp, model_info(neox, "n").d_head, model_info(neox, "n").n_kv_heads) == (640, 64, 4)
    llama = AutoConfig.for_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, intermediate_size=512)
    assert (model_info(llama, "l").d_mlp, model_info(llama, "l").d_head, model_info(llama, "l").n_kv_heads) == (512, 32, 2)


def test_gpt_neoxs_records_are_chosen_by_use_parallel_residual():
    from interp_engine.archs import model_info

    parallel = arch_for(AutoConfig.for_model("gpt_neox", use_parallel_residual=True))
    sequential = arch_for(AutoConfig.for_model("gpt_neox", use_parallel_residual=False))
    assert "resid_mid" not in parallel.sites and "resid_mid" in sequential.sites
    assert "no residual stream exists between them" in parallel.refused["resid_mid"]
    info = model_info(AutoConfig.for_model("gpt_neox", use_parallel_residual=True), "p")
    assert "resid_mid" not in info.sites and dict(info.refused)["resid_mid"] == parallel.refused["resid_mid"]
    # vLLM's Transformers backend keeps the decoder under model.*, the HF model under gpt_neox.*
    assert (parallel.layers, parallel.vllm_path("layers")) == ("gpt_neox.layers", "model.layers")
    assert parallel.vllm_path("unembed") == parallel.unembed == "lm_head"
    assert set(parallel.vllm_refused) == {"q", "k", "v"} and parallel.vllm_transformers_backend


def test_gpt2_is_the_record_that_stores_projections_in_out():
    gpt2 = arch_for(AutoConfig.for_model("gpt2"))
    assert gpt2.weights == "in_out" and [a.family for a in FAMILIES if a.weights == "in_out"] == ["gpt2"]
    with pytest.raises(ValueError, match="fits none of its family records"):
        arch_for(AutoConfig.for_model("gpt2", add_cross_attention=True))
