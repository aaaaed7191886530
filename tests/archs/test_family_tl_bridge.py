"""A second oracle for the families TransformerLens serves: its ``TransformerBridge`` (TransformerLens
3, installed with SAELens in the test extra) wraps the same Hugging Face module with hooks of its
own, written by other people; each of our sites at every layer equals its hook of the same meaning
within 1e-5 relative (fp32).

Compared where the two define the same tensor: the residual stream before, between and after the
blocks, what each block adds, the per-head attention output ``z``, ``pattern`` and the MLP's
activation; ``q`` / ``k`` / ``v`` on GPT-2, which has no rotary (ours are read as the attention
kernel takes them, after rotary; TransformerLens's hooks sit before it). GPT-NeoX with a parallel
block has no ``resid_mid`` (we refuse it), so it is left out there.
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import run_with_cache

from .. import tiny_gpt
from ..oracles import REL_SAME, assert_near

bridge_module = pytest.importorskip("transformer_lens.model_bridge")

#: our site -> TransformerLens's hook at layer L (the names written out here, not taken from our table)
HOOKS = {"resid_pre": "blocks.{}.hook_resid_pre", "resid_mid": "blocks.{}.hook_resid_mid",
         "resid_post": "blocks.{}.hook_resid_post", "attn_out": "blocks.{}.hook_attn_out",
         "mlp_out": "blocks.{}.hook_mlp_out", "z": "blocks.{}.attn.hook_z", "pattern": "blocks.{}.attn.hook_pattern",
         "mlp_post": "blocks.{}.mlp.hook_post", "q": "blocks.{}.attn.hook_q", "k": "blocks.{}.attn.hook_k",
         "v": "blocks.{}.attn.hook_v"}
SITES = {"gpt2": tuple(HOOKS),
         "gpt_neox": ("resid_pre", "resid_post", "attn_out", "mlp_out", "z", "pattern", "mlp_post"),
         "gpt_neox_sequential": ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "pattern",
                                 "mlp_post")}


@pytest.mark.parametrize("family", sorted(SITES))
def test_every_site_equals_transformerlens_bridge(family, tiny_root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interp_engine import load_model

    path = tiny_gpt.build(family, tiny_root)
    model = load_model(str(path), backend="eager")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")  # its own copy of the weights
    bridge = bridge_module.TransformerBridge.boot_transformers(str(path), hf_model=hf,
                                                               tokenizer=AutoTokenizer.from_pretrained(path))
    bridge.enable_compatibility_mode(no_processing=True)  # TransformerLens's hook names, weights untouched
    tokens = model.to_tokens("The quick brown fox jumps over")
    with torch.inference_mode():
        logits, theirs = bridge.run_with_cache(tokens)
    ours = run_with_cache(model, tokens, [*SITES[family], "logits"])
    assert_near(ours["logits"], logits, f"{family} logits", REL_SAME)
    for site in SITES[family]:
        for layer in range(model.n_layers):
            want = theirs[HOOKS[site].format(layer)]
            assert_near(ours[f"{site}.{layer}"], want, f"{family} {site}.{layer}", REL_SAME)
