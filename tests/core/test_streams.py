"""Multi-stream residuals (hyper-connections, AltUp) on the eager backend.

Oracle: transformers' own ``output_hidden_states``, which for these families records each
decoder layer's output — the whole stream tensor — through its own output recorder.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from interp_engine import AddressError, load_model, run_with_cache

from .. import tiny_moe

PROMPTS = ["Streams of thought", "Hi"]
#: how to take stream S out of each family's layer output, written independently of the engine
STREAM_OF = {
    "deepseek_v4": lambda out, s, n: out[:, :, s],
    "hy_v4": lambda out, s, n: out[:, :, s],
    "qwen4_exp": lambda out, s, n: out[..., s * out.shape[-1] // n:(s + 1) * out.shape[-1] // n],
    "gemma3n": lambda out, s, n: out[s],
}
#: the module that collapses the streams after the last layer (its input is the last layer's output)
FINAL_COLLAPSE = {"deepseek_v4": "model.hc_head", "hy_v4": "model.hc_head", "qwen4_exp": "model.hyper_connection_mixer"}


@pytest.fixture(scope="module")
def stream_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_streams")
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = load_model(str(tiny_moe.build(family, root)), backend="eager")
        return loaded[family]

    return get


def _layer_outputs(model, tokens):
    """Each decoder layer's output as the model returns it, via transformers' own recorder."""
    with torch.no_grad():
        out = model.hf(input_ids=tokens.clamp(min=0), attention_mask=tokens >= 0, output_hidden_states=True)
    return out.hidden_states


@pytest.mark.parametrize("family", tiny_moe.STREAM_FAMILIES)
def test_resid_streams_are_the_models_stream_tensor(stream_model, family):
    model = stream_model(family)
    info = model.info
    config = model.hf.config
    key = {"gemma3n": "altup_num_inputs", "qwen4_exp": "hc_count"}.get(family, "hc_mult")
    assert info.n_streams == getattr(config, key) > 1
    tokens = model.to_tokens(PROMPTS)
    # the last layer's output is replaced by the final collapse in hidden_states; compare the others
    layers = range(info.n_layers - 1)
    points = [f"resid_streams.{L}.{S}" for L in layers for S in range(info.n_streams)]
    cache = run_with_cache(model, tokens, points)
    hidden = _layer_outputs(model, tokens)
    for L in layers:
        own = hidden[L + 1]
        for S in range(info.n_streams):
            got = cache.get("resid_streams", L, S)
            assert got.shape == (*tokens.shape, info.d_model)
            want = STREAM_OF[family](own, S, info.n_streams)
            torch.testing.assert_close(got[cache.mask], want[cache.mask], rtol=1e-5, atol=1e-5)
    # the streams really differ (the test would not notice a stream mix-up otherwise)
    last = info.n_layers - 2
    assert not torch.allclose(cache.get("resid_streams", last, 0), cache.get("resid_streams", last, 1))


@pytest.mark.parametrize("family", tiny_moe.STREAM_FAMILIES)
def test_last_layer_streams_feed_the_final_collapse(stream_model, family):
    """The last layer has no hidden_states entry of its own; check it is the tensor the model's
    final collapse reads, with a hook of the test's own on that module."""
    model = stream_model(family)
    info = model.info
    tokens = model.to_tokens("Hi")
    L = info.n_layers - 1
    head = FINAL_COLLAPSE.get(family)
    if head is None:  # Gemma 3n: the layer output itself, from a hook on the last layer
        seen = []
        handle = model.hf.model.layers[L].register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    else:
        seen = []
        handle = model.hf.get_submodule(head).register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    try:
        cache = run_with_cache(model, tokens, [f"resid_streams.{L}.{S}" for S in range(info.n_streams)])
        model.hf(input_ids=tokens)
    finally:
        handle.remove()
    own = seen[-1]
    for S in range(info.n_streams):
        torch.testing.assert_close(cache.get("resid_streams", L, S), STREAM_OF[family](own, S, info.n_streams))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_stream_zero_of_a_dense_model_is_resid_post(eager_models, family):
    model = eager_models(family)
    tokens = model.to_tokens(PROMPTS)
    cache = run_with_cache(model, tokens, ["resid_streams.1.0", "resid_post.1"])
    assert torch.equal(cache.get("resid_streams", 1, 0), cache.get("resid_post", 1))


def test_stream_zero_of_an_moe_model_is_resid_post(tmp_path):
    model = load_model(str(tiny_moe.build("olmoe", tmp_path)), backend="eager")
    cache = run_with_cache(model, model.to_tokens(PROMPTS), ["resid_streams.2.0", "resid_post.2"])
    assert torch.equal(cache.get("resid_streams", 2, 0), cache.get("resid_post", 2))


#: How each family adds its blocks' outputs into the streams, written out from its decoder layer
#: (transformers 5.19): each yields (site, the streams as the model formed them, the same streams
#: rebuilt from the captured site and the model's own mixing modules). ``seen`` holds the first
#: input of the named submodules (``""``: the layer), the layer's output (``"out"``) and, for
#: Gemma 3n, what its AltUp ``correct`` step received (``"altup.correct"``). Qwen4-Exp serves no
#: ``attn_out_post`` (its linear-attention layers have no attention module to read it from).
def _deepseek_v4(layer, seen, attn_out, mlp_out):
    post, comb, _ = layer.attn_hc(seen["attn_hc"])
    yield "attn_out_post", seen["ffn_hc"], post.unsqueeze(-1) * attn_out.unsqueeze(-2) + comb.transpose(-1, -2) @ seen["attn_hc"]
    post, comb, _ = layer.ffn_hc(seen["ffn_hc"])
    yield "mlp_out_post", seen["out"], post.unsqueeze(-1) * mlp_out.unsqueeze(-2) + comb.transpose(-1, -2) @ seen["ffn_hc"]


def _hy_v4(layer, seen, attn_out, mlp_out):
    post, _ = layer.attn_hc(seen["attn_hc"])
    yield "attn_out_post", seen["ffn_hc"], post.unsqueeze(-1) * attn_out.unsqueeze(-2) + seen["attn_hc"]
    post, _ = layer.ffn_hc(seen["ffn_hc"])
    yield "mlp_out_post", seen["out"], post.unsqueeze(-1) * mlp_out.unsqueeze(-2) + seen["ffn_hc"]


def _qwen4_exp(layer, seen, attn_out, mlp_out):
    _, mixed, weights = layer.mlp_hyper_connection(seen["mlp_hyper_connection"])
    yield "mlp_out_post", seen["out"], mixed + (mlp_out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


def _gemma3n(layer, seen, attn_out, mlp_out):
    active = layer.altup.predict(seen[""])[layer.config.altup_active_idx]
    laurel = layer.laurel(layer.input_layernorm(active))
    yield "attn_out_post", seen["pre_feedforward_layernorm"], (active + attn_out + laurel) / math.sqrt(2)
    yield "mlp_out_post", seen["altup.correct"], seen["pre_feedforward_layernorm"] + mlp_out


BLOCKS_INTO_STREAMS = {
    "deepseek_v4": (_deepseek_v4, ("attn_hc", "ffn_hc")),
    "hy_v4": (_hy_v4, ("attn_hc", "ffn_hc")),
    "qwen4_exp": (_qwen4_exp, ("mlp_hyper_connection",)),
    "gemma3n": (_gemma3n, ("", "pre_feedforward_layernorm")),
}


@contextlib.contextmanager
def _watching(layer, names):
    """Record the first input of each named submodule, the layer's output and (Gemma 3n) the
    block output AltUp's ``correct`` receives, on the next forward."""
    seen = {}

    def keep(name):
        return lambda m, args, kwargs: seen.__setitem__(name, (args[0] if args else kwargs["hidden_states"]).clone())

    handles = [layer.get_submodule(n).register_forward_pre_hook(keep(n), with_kwargs=True) for n in names]
    handles.append(layer.register_forward_hook(
        lambda m, a, out: seen.__setitem__("out", (out[0] if isinstance(out, tuple) else out).clone())))
    altup = getattr(layer, "altup", None)
    if altup is not None:
        correct = altup.correct
        altup.correct = lambda predictions, activated: seen.__setitem__("altup.correct", activated.clone()) or correct(
            predictions, activated)
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
        if altup is not None:
            del altup.correct


@pytest.mark.parametrize("family", tiny_moe.STREAM_FAMILIES)
def test_block_outputs_on_a_multi_stream_model(stream_model, family):
    """attn_out_post / mlp_out_post are what each block writes before it is spread over the streams:
    the streams the model formed equal the streams rebuilt from the captured values through the
    layer's own mixing (e.g. DeepSeek-V4: stream k = post_k * mlp_out + sum_j comb[j, k] * stream_j
    before the MoE block). attn_out / mlp_out are the blocks' raw outputs: Gemma 3n norms them into
    the contributions, the others add them as they are."""
    model = stream_model(family)
    tokens = model.to_tokens(PROMPTS[0])
    L = 1
    rebuild, names = BLOCKS_INTO_STREAMS[family]
    sites = ["mlp_out_post"] if family == "qwen4_exp" else ["attn_out_post", "mlp_out_post"]
    raw = [site.removesuffix("_post") for site in sites]
    layer = model.hf.model.layers[L]
    with _watching(layer, names) as seen:
        cache = run_with_cache(model, tokens, [f"{site}.{L}" for site in sites + raw])
    got = {site: cache.get(site, L) for site in sites + raw}
    with torch.no_grad():
        for site in raw:
            normed = {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"}[site]
            want = layer.get_submodule(normed)(got[site]) if family == "gemma3n" else got[site]
            torch.testing.assert_close(got[f"{site}_post"], want, rtol=1e-5, atol=1e-5)
    checked = []
    with torch.no_grad():
        for site, formed, rebuilt in rebuild(layer, seen, got.get("attn_out_post"), got["mlp_out_post"]):
            assert got[site].shape == (1, tokens.shape[1], model.info.d_model)
            torch.testing.assert_close(rebuilt, formed, rtol=1e-5, atol=1e-5, msg=lambda m: f"{family} {site}: {m}")
            checked.append(site)
    assert checked == sites


# -- bad inputs ------------------------------------------------------------------------------------


def test_stream_index_out_of_range(stream_model, eager_models):
    model = stream_model("deepseek_v4")
    with pytest.raises(AddressError, match=r"has streams 0\.\.3"):
        run_with_cache(model, model.to_tokens("Hi"), ["resid_streams.0.4"])
    dense = eager_models("llama")
    with pytest.raises(AddressError, match="single residual stream, so only stream 0"):
        run_with_cache(dense, dense.to_tokens("Hi"), ["resid_streams.0.1"])


@pytest.mark.parametrize("site", ["resid_pre", "resid_mid", "resid_post"])
def test_single_stream_sites_on_a_multi_stream_model_point_to_the_streams(stream_model, site):
    model = stream_model("gemma3n")
    with pytest.raises(AddressError, match=r"residual is 3 streams.*'resid_streams\.1\.0', 'resid_streams\.1\.1'"):
        run_with_cache(model, model.to_tokens("Hi"), [f"{site}.1"])


def test_sites_a_family_table_lacks_are_refused_with_the_valid_list(stream_model):
    model = stream_model("deepseek_v4")
    with pytest.raises(AddressError, match="deepseek_v4 family table has no 'z'.*valid sites: attn_out, attn_out_post, mlp_out"):
        run_with_cache(model, model.to_tokens("Hi"), ["z.0"])


def test_gemma3n_attention_sites_on_kv_shared_layers(stream_model):
    """Gemma 3n's last ``num_kv_shared_layers`` layers attend to the keys and values of the last
    earlier layer of the same attention type; k / v there are those shared tensors."""
    model = stream_model("gemma3n")
    config = model.hf.config
    n, shared = config.num_hidden_layers, config.num_kv_shared_layers
    points = [f"{s}.{L}" for L in range(n) for s in ("k", "v", "pattern")]
    cache = run_with_cache(model, model.to_tokens(PROMPTS), points)
    for L in range(n - shared, n):
        source = max(i for i in range(n - shared) if config.layer_types[i] == config.layer_types[L])
        for site in ("k", "v"):
            assert torch.equal(cache.get(site, L), cache.get(site, source)), f"{site}.{L} is {site}.{source}"
    batch, pos = cache.mask.nonzero(as_tuple=True)
    rows = cache.get("pattern", n - 1)[batch, :, pos]  # each real query row of each head
    torch.testing.assert_close(rows.sum(-1), torch.ones_like(rows.sum(-1)))


@pytest.mark.parametrize("family", tiny_moe.STREAM_FAMILIES)
def test_every_listed_model_level_point_is_captured_and_final_norm_feeds_the_unembedding(stream_model, family):
    """A point the model lists must be capturable (Qwen4-Exp listed final_norm with no model.norm);
    final_norm is what the unembedding reads: the model's own lm_head of it is the lm_head point."""
    from interp_engine.points import valid_sites

    model = stream_model(family)
    listed = [s for s in ("embeddings", "final_norm", "lm_head", "logits", "ln_final_normalized")
              if s in valid_sites(model.info, model.capabilities)]
    assert {"final_norm", "lm_head"} <= set(listed), listed
    cache = run_with_cache(model, model.to_tokens("Streams of thought"), listed)
    with torch.no_grad():
        unembedded = model.hf.lm_head(cache.get("final_norm").to(model.device))
    torch.testing.assert_close(cache.get("lm_head"), unembedded.to(cache.get("lm_head").device))
