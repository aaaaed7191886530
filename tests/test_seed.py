"""The seed's examples, as written, with the embedded SmolLM2 in place of the hub models
they name (this machine has no model hub). Each block below is one section of the seed."""

import pytest
import torch

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_one_point():
    from interp_engine import Address, load_model, run_with_cache

    model = load_model(SMOL)
    point = Address("resid_post", 10)

    cache = run_with_cache(model, model.to_tokens("The capital of France is"), [point])
    assert cache[point].shape == (1, 5, model.d_model)  # [batch, pos, d_model]


def test_several_points():
    from interp_engine import load_model, run_with_cache

    model = load_model(SMOL)
    tokens = model.to_tokens("The capital of France is")

    cache = run_with_cache(model, tokens, ["resid_post.10", "mlp_out.10", "attn_out.10"])
    mlp = cache.get("mlp_out", 10)
    assert mlp.shape == (1, 5, 576)
    torch.testing.assert_close(
        cache.get("resid_post", 10) - mlp - cache.get("attn_out", 10),
        model.hf(input_ids=tokens, output_hidden_states=True).hidden_states[10],
        atol=1e-4, rtol=1e-5,
    )


def test_every_layer():
    from interp_engine import Address, load_model, run_with_cache

    model = load_model(SMOL)
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]

    cache = run_with_cache(model, model.to_tokens("Hello"), points)
    assert len(cache) == model.n_layers == 30


def test_naming_a_point():
    from interp_engine import Address, format_address, parse_address, to_address

    assert Address("resid_post", 10) == parse_address("resid_post.10")
    assert to_address(("mlp_out", 3)) == Address("mlp_out", 3)
    assert Address("resid_streams", 5, 2).stream == 2
    assert format_address(Address("z", 7)) == "z.7"


def test_string_lookup_on_cache_but_not_on_async_dict():
    import asyncio

    from interp_engine import Address, load_model, run_with_cache

    model = load_model(SMOL)
    tokens = model.to_tokens("Hello")
    cache = run_with_cache(model, tokens, ["resid_post.3"])
    assert cache["resid_post.3"] is cache[Address("resid_post", 3)]
    plain = asyncio.run(model.capture(tokens, ["resid_post.3"]))
    assert torch.equal(plain[Address("resid_post", 3)], cache["resid_post.3"])
    with pytest.raises(KeyError):
        plain["resid_post.3"]


def test_while_generating_eager():
    from interp_engine import capture_generation, load_model

    model = load_model(SMOL)
    tokens = model.to_tokens("The capital of France is")

    completion, cache = capture_generation(model, tokens, ["resid_post.10"], max_tokens=8)
    print(completion.text, completion.token_ids)
    assert completion.text.startswith(" Paris")
    generated = len(completion.token_ids)
    assert cache.get("resid_post", 10).shape[1] == tokens.shape[1] + generated - 1


def test_a_batch():
    from interp_engine import load_model, run_with_cache

    model = load_model(SMOL, backend="eager")
    tokens = model.tok.to_tokens(["Paris is in", "Berlin is in"])

    cache = run_with_cache(model, tokens, ["resid_post.10"])
    assert cache.get("resid_post", 10).shape[:2] == (2, tokens.shape[1])  # [2, pos, d_model]


def test_per_head_contributions():
    from interp_engine import head_contributions, load_model, run_with_cache

    model = load_model(SMOL, backend="eager")
    cache = run_with_cache(model, model.to_tokens("Hello"), ["z.10"])
    heads = head_contributions(model, cache, 10)  # [batch, pos, n_heads, d_model]
    assert heads.shape == (1, 1, 9, 576)


def test_gradients():
    from interp_engine import load_model, run_with_cache

    model = load_model(SMOL, backend="eager", requires_grad=True)
    cache = run_with_cache(model, model.to_tokens("Hello"), ["resid_post.10"], detach=False)
    cache.get("resid_post", 10).sum().backward()
    assert model.hf.model.embed_tokens.weight.grad.abs().sum() > 0
