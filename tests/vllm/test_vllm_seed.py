"""The seed's "One point", "Several points", "Every layer" and "While generating" examples with
``backend="vllm"``, on the embedded SmolLM2 in place of the hub models they name.

Each example opens with ``model = load_model(...)``; that line runs once, as written, in the
module fixture (an engine start is the slow part), and each test is the rest of its example
as written, plus checks against the eager backend on the same weights.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def model():
    from interp_engine import load_model

    model = load_model(SMOL, backend="vllm")
    yield model
    model.close()


@pytest.fixture(scope="module")
def eager():
    from interp_engine import load_model

    return load_model(SMOL, backend="eager")


def test_one_point(model, eager):
    from interp_engine import Address, run_with_cache

    point = Address("resid_post", 10)

    cache = run_with_cache(model, model.to_tokens("The capital of France is"), [point])
    cache[point]  # [batch, pos, d_model]

    assert cache[point].shape == (1, 5, model.d_model)
    want = run_with_cache(eager, eager.to_tokens("The capital of France is"), [point])[point]
    assert float((cache[point] - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_several_points(model, eager):
    from interp_engine import run_with_cache

    tokens = model.to_tokens("The capital of France is")

    cache = run_with_cache(model, tokens, ["resid_post.10", "mlp_out.10", "attn_out.10"])
    cache.get("mlp_out", 10)

    want = run_with_cache(eager, tokens, ["resid_post.10", "mlp_out.10", "attn_out.10"])
    for point in want:
        assert float((cache[point] - want[point]).abs().max()) <= 1e-4 * float(want[point].abs().max())


def test_every_layer(model, eager):
    from interp_engine import Address, run_with_cache

    points = [Address("resid_post", layer) for layer in range(model.n_layers)]

    cache = run_with_cache(model, model.to_tokens("Hello"), points)

    assert len(cache) == model.n_layers == 30
    assert all(cache[p].shape == (1, model.to_tokens("Hello").shape[1], model.d_model) for p in points)
    want = run_with_cache(eager, eager.to_tokens("Hello"), points)
    for p in points:  # the values too, every layer, against the eager backend
        assert float((cache[p] - want[p]).abs().max()) <= 1e-4 * float(want[p].abs().max()), p


def test_while_generating(model, eager):
    from interp_engine import capture_generation

    tokens = model.to_tokens("The capital of France is")

    completion, cache = capture_generation(model, tokens, ["resid_post.10"], max_tokens=8)
    print(completion.text, completion.token_ids)
    cache.get("resid_post", 10).shape[1]  # len(prompt) + len(generated) - 1

    assert completion.text.startswith(" Paris")
    assert cache.get("resid_post", 10).shape[1] == tokens.shape[1] + len(completion.token_ids) - 1
    expected, oracle = capture_generation(eager, tokens, ["resid_post.10"], max_tokens=8)
    assert completion.token_ids == expected.token_ids
    torch.testing.assert_close(cache["resid_post.10"], oracle["resid_post.10"], rtol=1e-4, atol=1e-3)
