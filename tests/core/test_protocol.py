"""The backend contract (interp_engine/protocol.py): every eager model implements it here; the
vLLM and cluster models are checked beside their own fixtures (test_edits_vllm.py,
test_edits_cluster.py) with the same :func:`assert_contract`."""

from __future__ import annotations

import pytest
import torch

from interp_engine import Cache, head_contributions, logit_attribution, logit_lens

from ..contract import assert_contract


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "gemma3n"])
def test_every_eager_model_implements_the_contract(eager_models, family):
    assert_contract(eager_models(family), writes_shards=False)


def test_a_model_without_a_capability_gets_an_error_naming_it():
    cache = Cache({}, torch.zeros(1, 2, dtype=torch.long), None, "m", "eager")
    with pytest.raises(TypeError, match="head_contributions needs .* object has no o_proj_weight: pass the model"):
        head_contributions(object(), cache, 0)
    with pytest.raises(TypeError, match="logit_attribution needs .* object has no final_norm or unembed_weight"):
        logit_attribution(object(), cache, 0)
    with pytest.raises(TypeError, match="logit_lens needs .* object has no final_norm or unembed: pass the model"):
        logit_lens(object(), cache)
