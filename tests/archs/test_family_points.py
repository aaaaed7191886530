"""The points every engine names around a block (issue 37): what each block is handed (``attn_in``,
``mlp_in``), the pre-norms' outputs before their gain (``ln1_normalized`` / ``ln2_normalized``,
TransformerLens's ``hook_normalized``), the MLP's pre-activations (``mlp_pre``, ``mlp_pre_linear``),
the embedding module's output (``embeddings``), the unembedding's output (``lm_head``) and the final
norm before its gain (``ln_final_normalized``), per family, on the eager backend.

Each is checked against an oracle that shares no code with the engine: the Hugging Face modules'
own inputs and outputs recorded by this test's hooks (module paths written out below, not read
from the family tables), and the normalisation written out from the norm's input and epsilon,
which times the norm's gain (and plus its bias) must give the norm's own output."""

import pytest
import torch

from interp_engine import run_with_cache

from .. import tiny_gpt
from ..oracles import REL_SAME, assert_near

PROMPTS = ["The quick brown fox jumps over", "A lazy dog"]

#: per family, written out from transformers 5.19's decoder layers: the layer list, the attention
#: and MLP modules, the two pre-norms (None: the family has none), the gate / up projections (None:
#: not separate modules), the embedding, final norm and unembedding, and how a norm applies its
#: gain ("w": weight * x, "1+w": (1 + weight) * x, "ln": LayerNorm weight * x + bias)
LLAMA = dict(layers="model.layers", attn="self_attn", mlp="mlp", ln1="input_layernorm", ln2="post_attention_layernorm",
             gate="mlp.gate_proj", up="mlp.up_proj", embed="model.embed_tokens", final="model.norm", unembed="lm_head",
             gain="w")
FAMILIES = {
    "llama": LLAMA,
    "qwen3": LLAMA,
    "phi3": {**LLAMA, "gate": None, "up": None},
    "gemma": {**LLAMA, "gain": "1+w"},
    "gemma2": {**LLAMA, "ln2": "pre_feedforward_layernorm", "gain": "1+w"},
    "gemma3": {**LLAMA, "ln2": "pre_feedforward_layernorm", "gain": "1+w"},
    "olmo2": {**LLAMA, "ln1": None, "ln2": None},
    "gpt_oss": {**LLAMA, "gate": None, "up": None},
    "qwen3_5": {**LLAMA, "attn": "linear_attn|self_attn", "gain": "1+w"},
    "gpt2": dict(layers="transformer.h", attn="attn", mlp="mlp", ln1="ln_1", ln2="ln_2", gate="mlp.c_fc", up=None,
                 embed="transformer.wte", final="transformer.ln_f", unembed="lm_head", gain="ln"),
    "gpt_neox": dict(layers="gpt_neox.layers", attn="attention", mlp="mlp", ln1="input_layernorm",
                     ln2="post_attention_layernorm", gate="mlp.dense_h_to_4h", up=None, embed="gpt_neox.embed_in",
                     final="gpt_neox.final_layer_norm", unembed="lm_head", gain="ln"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family, eager_models, tiny_root):
    if family in ("gpt2", "gpt_neox"):
        from interp_engine import load_model

        return load_model(str(tiny_gpt.build(family, tiny_root)), backend="eager")
    return eager_models(family)


def _module(layer, path):
    for option in path.split("|"):
        try:
            return layer.get_submodule(option)
        except AttributeError:
            continue
    raise AssertionError(f"no {path} in {type(layer).__name__}")


def _first(args, kwargs):
    return (args[0] if args else kwargs["hidden_states"]).detach().clone()


def _output(out):
    return (out[0] if isinstance(out, tuple) else out).detach().clone()


def _hf_run(model, layout, tokens, mask):
    """The Hugging Face model's own forward with this test's hooks: every module's input / output
    that the points name, by (layer, role)."""
    hf = model.hf
    seen, handles = {}, []

    def pre(key):
        return lambda m, args, kwargs: seen.__setitem__(key, _first(args, kwargs))

    def post(key):
        return lambda m, args, out: seen.__setitem__(key, _output(out))

    for i, layer in enumerate(hf.get_submodule(layout["layers"])):
        watched = [("attn", pre), ("mlp", pre), ("ln1", pre), ("ln2", pre), ("ln1", post), ("ln2", post),
                   ("gate", post), ("up", post)]
        for role, kind in watched:
            if layout[role]:
                module = _module(layer, layout[role])
                key = (i, role, kind.__name__)
                handles.append(module.register_forward_pre_hook(kind(key), with_kwargs=True) if kind is pre
                               else module.register_forward_hook(kind(key)))
    for role, kind in (("embed", post), ("final", pre), ("final", post), ("unembed", post)):
        module = hf.get_submodule(layout[role])
        key = (None, role, kind.__name__)
        handles.append(module.register_forward_pre_hook(kind(key), with_kwargs=True) if kind is pre
                       else module.register_forward_hook(kind(key)))
    try:
        with torch.no_grad():
            out = hf(input_ids=tokens.clamp(min=0), attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return seen, out.logits


def _normalized(x, eps, centre):
    """The norm's division written out: ``x / rms(x)`` (``(x - mean) / std`` for a LayerNorm)."""
    h = x.double()
    if centre:
        h = h - h.mean(-1, keepdim=True)
    return (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).float()


def _gained(norm, normalized, gain):
    """What the norm outputs given its normalisation: the gain (and bias) applied."""
    if gain == "ln":
        return normalized * norm.weight + norm.bias
    return normalized * ((1.0 + norm.weight.float()) if gain == "1+w" else norm.weight)


def _eps(norm):
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


NEW = ["attn_in", "mlp_in", "ln1_normalized", "ln2_normalized", "mlp_pre", "mlp_pre_linear"]


def test_block_inputs_norms_and_mlp_preactivations(model, family):
    layout = FAMILIES[family]
    tokens = model.to_tokens(PROMPTS)
    mask = tokens >= 0
    seen, logits = _hf_run(model, layout, tokens, mask)
    served = {a.name for a in model.points()}
    want = {"attn_in", "mlp_in", "embeddings", "lm_head", "ln_final_normalized"}
    want |= {"ln1_normalized", "ln2_normalized"} if layout["ln1"] else set()
    want |= {"mlp_pre"} if layout["gate"] else set()
    want |= {"mlp_pre_linear"} if layout["up"] else set()
    assert served & {*NEW, "embeddings", "lm_head", "ln_final_normalized"} == want
    n = model.n_layers
    points = [f"{s}.{L}" for s in NEW if s in served for L in range(n)]
    cache = run_with_cache(model, tokens, points + ["embeddings", "lm_head", "ln_final_normalized", "logits",
                                                    "mlp_post.0" if "mlp_pre" in served else "logits"])
    real = mask
    layers = model.hf.get_submodule(layout["layers"])
    for L in range(n):
        assert_near(cache.get("attn_in", L)[real], seen[(L, "attn", "pre")][real], f"attn_in.{L}", REL_SAME)
        assert_near(cache.get("mlp_in", L)[real], seen[(L, "mlp", "pre")][real], f"mlp_in.{L}", REL_SAME)
        for role, site in (("ln1", "ln1_normalized"), ("ln2", "ln2_normalized")):
            if not layout[role]:
                continue
            norm = _module(layers[L], layout[role])
            x = seen[(L, role, "pre")]
            normalized = _normalized(x, _eps(norm), layout["gain"] == "ln")
            got = cache.get(site, L)
            assert_near(got[real], normalized[real], f"{site}.{L}", 1e-5)
            with torch.no_grad():
                assert_near(_gained(norm, got, layout["gain"])[real], seen[(L, role, "post")][real],
                            f"{site}.{L} times the gain is the norm's output", 1e-5)
        if layout["gate"]:
            assert_near(cache.get("mlp_pre", L)[real], seen[(L, "gate", "post")][real], f"mlp_pre.{L}", REL_SAME)
        if layout["up"]:
            assert_near(cache.get("mlp_pre_linear", L)[real], seen[(L, "up", "post")][real], f"mlp_pre_linear.{L}",
                        REL_SAME)
    if layout["gate"] and layout["up"]:  # the neurons: act(mlp_pre) * mlp_pre_linear
        act = _module(layers[0], layout["mlp"]).act_fn
        product = act(cache.get("mlp_pre", 0)) * cache.get("mlp_pre_linear", 0)
        assert_near(product[real], cache.get("mlp_post", 0)[real], "act(mlp_pre) * mlp_pre_linear", REL_SAME)
    assert_near(cache["embeddings"][real], seen[(None, "embed", "post")][real], "embeddings", REL_SAME)
    assert_near(cache["lm_head"][real], seen[(None, "unembed", "post")][real], "lm_head", REL_SAME)
    final = model.hf.get_submodule(layout["final"])
    normalized = _normalized(seen[(None, "final", "pre")], _eps(final), layout["gain"] == "ln")
    assert_near(cache["ln_final_normalized"][real], normalized[real], "ln_final_normalized", 1e-5)
    cap = getattr(model.hf.config, "final_logit_softcapping", None)
    capped = torch.tanh(cache["lm_head"] / cap) * cap if cap else cache["lm_head"]
    assert_near(capped[real], cache["logits"][real], "logits = softcap(lm_head)", REL_SAME)


def test_embeddings_is_the_token_embedding_before_positions(model, family):
    """GPT-2 adds its learned positions after the embedding module: ``embeddings`` is the token
    rows alone, ``resid_pre.0`` the sum. Gemma's embedding modules scale themselves by
    sqrt(d_model) (transformers 5.19), so there the module's output is the scaled rows."""
    tokens = model.to_tokens(PROMPTS[0])
    cache = run_with_cache(model, tokens, ["embeddings", "resid_pre.0"])
    rows = model.hf.get_submodule(FAMILIES[family]["embed"]).weight[tokens]
    if family.startswith("gemma"):
        rows = rows * torch.tensor(model.d_model**0.5, dtype=rows.dtype)
    assert_near(cache["embeddings"], rows, "embeddings", REL_SAME)
    if family == "gpt2":
        positions = model.hf.transformer.wpe.weight[: tokens.shape[1]]
        assert_near(cache["resid_pre.0"], rows + positions, "resid_pre.0 = embeddings + positions", REL_SAME)


#: where each family applies its q / k norms (written out from transformers 5.19): per head on
#: ``[b, p, heads, d_head]`` (Gemma 3 on ``[b, heads, p, d_head]``, served as ``[b, p, heads, d_head]``),
#: or over all heads on ``[b, p, heads * d_head]``
QK_NORM = {"qwen3": "head", "gemma3": "heads first", "olmo2": "all"}


@pytest.mark.parametrize("family", sorted(QK_NORM))
def test_qk_norm_points_are_the_norms_own_input_and_output(family, eager_models):
    """``q_norm_in`` / ``q_norm_out`` / ``k_norm_*`` are what the family's q / k norm modules take and
    give, in the layout they apply them (the peer's shapes); ``q`` is ``q_norm_out`` after rotary,
    so the two agree at position 0, where rotary is the identity."""
    model = eager_models(family)
    tokens = model.to_tokens(PROMPTS[0])
    n = model.n_layers
    seen, handles = {}, []
    for L, layer in enumerate(model.hf.model.layers):
        for x in ("q", "k"):
            norm = layer.self_attn.get_submodule(f"{x}_norm")
            handles.append(norm.register_forward_pre_hook(
                lambda m, args, L=L, x=x: seen.__setitem__((L, x, "in"), args[0].detach().clone())))
            handles.append(norm.register_forward_hook(
                lambda m, args, out, L=L, x=x: seen.__setitem__((L, x, "out"), out.detach().clone())))
    try:
        cache = run_with_cache(model, tokens, [f"{x}_norm_{io}.{L}" for x in "qk" for io in ("in", "out")
                                               for L in range(n)] + [f"q.{L}" for L in range(n)])
    finally:
        for h in handles:
            h.remove()
    heads = QK_NORM[family] != "all"
    for L in range(n):
        for x in ("q", "k"):
            for io in ("in", "out"):
                got = cache.get(f"{x}_norm_{io}", L)
                want = seen[(L, x, io)].transpose(1, 2) if QK_NORM[family] == "heads first" else seen[(L, x, io)]
                assert_near(got, want, f"{x}_norm_{io}.{L}", REL_SAME)
                assert got.dim() == (4 if heads else 3)
        q_out = cache.get("q_norm_out", L)
        per_head = q_out if heads else q_out.unflatten(-1, (model.n_heads, -1))
        assert_near(cache.get("q", L)[:, 0], per_head[:, 0], f"q.{L} at position 0", 1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "olmo2", "gpt_oss", "deepseek_v3"])
def test_attn_scores_are_what_the_softmax_takes(family, eager_models):
    """``attn_scores`` against two oracles: written out from the captured ``q`` / ``k`` (``q k^T``
    over sqrt of the head width, through Gemma 2's attention softcap, where the query may see
    the key), and its softmax is ``pattern`` (GPT-OSS: with each head's sink as one more column,
    dropped after). Keys a query cannot see hold the dtype's minimum."""
    model = eager_models(family)
    tokens = model.to_tokens(PROMPTS[0])
    L = model.n_layers - 1
    attention = model.hf.model.layers[L].self_attn
    cap = getattr(attention, "attn_logit_softcapping", None)
    if cap:  # the tiny model's scores are far below its cap of 50: a cap of 0.2 makes it bite
        attention.attn_logit_softcapping = cap = 0.2
    try:
        cache = run_with_cache(model, tokens, [f"{s}.{L}" for s in ("attn_scores", "pattern", "q", "k")])
    finally:
        if cap:
            attention.attn_logit_softcapping = model.hf.config.attn_logit_softcapping
    scores, pattern = cache.get("attn_scores", L), cache.get("pattern", L)
    if family == "gpt_oss":
        sinks = attention.sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    assert_near(probs, pattern, f"softmax(attn_scores.{L})", 1e-5)
    q, k = cache.get("q", L).transpose(1, 2), cache.get("k", L).transpose(1, 2)  # [b, heads, p, d]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    manual = q @ k.transpose(-1, -2) * attention.scaling
    if cap:
        manual = torch.tanh(manual / cap) * cap
    seen = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    if getattr(attention, "sliding_window", None):
        seen &= ~torch.ones_like(seen).tril(-attention.sliding_window)
    assert_near(scores[..., seen], manual[..., seen], f"attn_scores.{L} = q k^T * scaling", 1e-5)
    assert torch.all(scores[..., ~seen] == torch.finfo(scores.dtype).min)
