"""Edits on the eager backend, each checked against a hand-written Hugging Face hook that does
the same edit (an independent oracle: plain forward hooks, a rewritten decoder layer for
resid_mid, a registered attention function for q / k / v / pattern)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from interp_engine import Add, AddressError, InputError, Scale, Set, Zero, capture_generation, load_model, run_with_cache
from interp_engine.backends.eager import attention

from ..oracles import assert_near
from ..devices import load_kwargs, on

LAYER = 1
PROMPT = "edit me, please"
# where a hand-written hook finds each site in a Llama layer (written out here, not read from the
# library's table, so the oracle does not share the code under test)
LLAMA_OUT = {"attn_out": "self_attn", "attn_out_post": "self_attn", "mlp_out": "mlp", "mlp_out_post": "mlp",
             "resid_post": ""}
LLAMA_IN = {"resid_pre": "", "z": "self_attn.o_proj", "mlp_post": "mlp.down_proj"}
ATTENTION = ("q", "k", "v", "pattern")


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(PROMPT)


def _block(model, site):
    info = model.info
    return {"z": (info.n_heads, info.d_head), "q": (info.n_heads, info.d_head),
            "k": (info.n_kv_heads, info.d_head), "v": (info.n_kv_heads, info.d_head),
            "mlp_post": (info.d_mlp,)}.get(site, (info.d_model,))


def _kinds(model, site, length):
    """One edit of each kind for ``site``, with the plain function doing the same to a
    ``[batch, pos, *block]`` tensor (positions: prompt positions edited)."""
    g = torch.Generator().manual_seed(len(site))
    if site == "pattern":
        block = (model.n_heads, length)
    else:
        block = _block(model, site)
    vector = on(model, torch.randn(block, generator=g))
    value = on(model, torch.randn(block, generator=g))
    head = site in ("z", "q", "k", "v", "pattern")

    def at(positions, change, heads=None):
        def fn(t):
            out = t.clone()
            for p in positions:
                if heads is None:
                    out[:, p] = change(t[:, p])
                else:
                    out[:, p, heads] = change(t[:, p, heads])
            return out
        return fn

    every = list(range(length))
    return {
        "add": (Add(vector, scale=2.0, positions=[1, -1]), at([1, length - 1], lambda x: x + 2.0 * vector)),
        "scale": (Scale(0.25), at(every, lambda x: 0.25 * x)),
        "set": (Set(value, positions=[2]), at([2], lambda x: value.expand_as(x))),
        "zero": ((Zero(heads=[1]), at(every, torch.zeros_like, heads=[1])) if head
                 else (Zero(positions=-2), at([length - 2], torch.zeros_like))),
    }


#: Gemma 2 normalises each block's output before the add: the contributions are those norms' outputs,
#: the raw outputs the blocks'
GEMMA2_OUT = {"attn_out": "self_attn", "attn_out_post": "post_attention_layernorm", "mlp_out": "mlp",
              "mlp_out_post": "post_feedforward_layernorm", "resid_post": ""}


def _llama_mid(layer, fn):
    """Llama's decoder layer written out, with ``fn`` applied to resid_mid."""
    def rewritten(hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                  use_cache=False, position_embeddings=None, **kwargs):
        residual = hidden_states
        h, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                               position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                               position_embeddings=position_embeddings, **kwargs)
        mid = fn(residual + h)
        return mid + layer.mlp(layer.post_attention_layernorm(mid))
    return rewritten


def _gemma2_mid(layer, fn):
    """Gemma 2's decoder layer written out (each block's output normed before the add), with
    ``fn`` applied to resid_mid."""
    def rewritten(hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                  past_key_values=None, **kwargs):
        h, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                               position_ids=position_ids, past_key_values=past_key_values,
                               position_embeddings=position_embeddings, **kwargs)
        mid = fn(hidden_states + layer.post_attention_layernorm(h))
        return mid + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(mid)))
    return rewritten


def _oracle(model, tokens, site, fn, outputs=LLAMA_OUT, mid=_llama_mid):
    """Logits and resid_post of the last layer with ``fn`` applied to ``site.LAYER`` by hand."""
    hf = model.hf
    layer = hf.model.layers[LAYER]
    last = {}
    handles = [hf.model.layers[-1].register_forward_hook(lambda m, a, o: last.update(value=o))]
    forward = None
    name = f"oracle_{site}"
    try:
        if site in outputs:
            module = layer.get_submodule(outputs[site])
            handles.append(module.register_forward_hook(
                lambda m, a, o: (fn(o[0]), *o[1:]) if isinstance(o, tuple) else fn(o)))
        elif site in LLAMA_IN:
            module = layer.get_submodule(LLAMA_IN[site])
            if site == "z":
                h, d = model.n_heads, model.d_head
                handles.append(module.register_forward_pre_hook(
                    lambda m, a: (fn(a[0].unflatten(-1, (h, d))).flatten(-2),)))
            else:
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, k: ((fn(a[0]), *a[1:]), k) if a else (a, {**k, "hidden_states": fn(k["hidden_states"])}),
                    with_kwargs=True))
        elif site == "resid_mid":
            forward = layer.forward
            layer.forward = mid(layer, fn)
        else:  # q / k / v / pattern: an attention function of our own, on this layer only
            def attend(module, query, key, value, mask, **kwargs):
                if module is not layer.self_attn:  # the family's own (softcapping where it has one)
                    return sys.modules[type(module).__module__].eager_attention_forward(
                        module, query, key, value, mask, **kwargs)
                edit = lambda t: fn(t.transpose(1, 2)).transpose(1, 2)  # noqa: E731
                if site == "q":
                    query = edit(query)
                elif site == "k":
                    key = edit(key)
                elif site == "v":
                    value = edit(value)
                groups = query.shape[1] // key.shape[1]
                k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
                scores = query @ k.transpose(2, 3) * module.scaling
                if kwargs.get("softcap"):  # Gemma 2's attention softcapping
                    scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
                scores = scores + mask
                probs = torch.softmax(scores, dim=-1)
                if site == "pattern":
                    probs = edit(probs)
                return (probs @ v).transpose(1, 2).contiguous(), probs

            ALL_ATTENTION_FUNCTIONS.register(name, attend)
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, eager_mask)  # an additive float mask
        with torch.no_grad(), attention.using(hf, name) if site in ATTENTION else _nothing():
            logits = hf(input_ids=on(model, tokens), use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
        if forward is not None:
            layer.forward = forward
    return logits, last["value"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SITES = ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "z", "mlp_post", "q", "k", "v", "pattern"]


@pytest.mark.parametrize("kind", ["add", "scale", "set", "zero"])
@pytest.mark.parametrize("site", SITES)
def test_edit_equals_hand_written_hook(model, tokens, site, kind):
    edit, fn = _kinds(model, site, tokens.shape[1])[kind]
    last = f"resid_post.{model.n_layers - 1}"
    got = run_with_cache(model, tokens, ["logits", last], edits={f"{site}.{LAYER}": edit})
    want_logits, want_last = _oracle(model, tokens, site, fn)
    plain = run_with_cache(model, tokens, ["logits"])
    assert not torch.allclose(got["logits"], plain["logits"]), "the edit changed nothing: a test that cannot fail"
    assert_near(got["logits"], want_logits, f"{site} {kind} logits", 1e-5)
    assert_near(got[last], want_last, f"{site} {kind} {last}", 1e-5)


@pytest.mark.parametrize("site", ["resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post",
                                  "resid_post", "z", "mlp_post", "q", "k", "v"])
def test_gemma2_edit_equals_hand_written_hook(eager_models, site):
    model = eager_models("gemma2")
    tokens = model.to_tokens(PROMPT)
    plain = run_with_cache(model, tokens, ["logits"])
    for kind in ("add", "zero"):
        edit, fn = _kinds(model, site, tokens.shape[1])[kind]
        last = f"resid_post.{model.n_layers - 1}"
        got = run_with_cache(model, tokens, ["logits", last], edits={f"{site}.{LAYER}": edit})
        assert (got["logits"] - plain["logits"]).abs().max() > 1e-4, f"gemma2 {site} {kind} changed nothing"
        want_logits, want_last = _oracle(model, tokens, site, fn, GEMMA2_OUT, _gemma2_mid)
        assert_near(got["logits"], want_logits, f"gemma2 {site} {kind} logits", 1e-5)
        assert_near(got[last], want_last, f"gemma2 {site} {kind} {last}", 1e-5)


@pytest.mark.parametrize("site", ["resid_mid", "resid_post", "z", "attn_out"])
def test_capture_of_edited_point_is_after_the_edit(model, tokens, site):
    address = f"{site}.{LAYER}"
    plain = run_with_cache(model, tokens, [address])[address]
    edited = run_with_cache(model, tokens, [address], edits={address: Scale(3.0)})[address]
    if site == "resid_mid":  # written as a change of attn_out: equal up to one float rounding
        assert_near(edited, 3.0 * plain, address, 1e-6)
    else:
        assert torch.equal(edited, 3.0 * plain)


def test_patching_every_position_of_resid_pre_0_recovers_clean_logits(model):
    clean, corrupt = model.to_tokens("The cat sat on the mat"), model.to_tokens("The dog ran in the sun")
    assert clean.shape == corrupt.shape
    cache = run_with_cache(model, clean, ["resid_pre.0", "logits"])
    patched = run_with_cache(model, corrupt, ["logits"], edits={"resid_pre.0": Set(cache["resid_pre.0"])})
    assert torch.equal(patched["logits"], cache["logits"])
    per_position = {"resid_pre.0": Set(cache["resid_pre.0"][0, 3], positions=[3])}
    one = run_with_cache(model, corrupt, ["logits"], edits=per_position)["logits"]
    assert not torch.equal(one, cache["logits"])  # one position patched is not the clean run


def test_norm_relative_equals_two_pass(model, tokens):
    address = f"resid_post.{LAYER}"
    vector = on(model, torch.randn(model.d_model, generator=torch.Generator().manual_seed(3)))
    one_pass = run_with_cache(model, tokens, ["logits"], edits={address: Add(vector, scale=0.5, norm_relative=True)})
    norms = run_with_cache(model, tokens, [address])[address].norm(dim=-1, keepdim=True)  # [1, pos, 1]
    full = run_with_cache(model, tokens, [address])[address] + 0.5 * norms * vector / vector.norm()
    two_pass = run_with_cache(model, tokens, ["logits"], edits={address: Set(full)})
    assert_near(one_pass["logits"], two_pass["logits"], "norm-relative steering", 1e-5)


def test_padded_batch_edits_each_rows_own_positions(model):
    tokens = model.to_tokens(["a short one", "a somewhat longer prompt"])
    edit = {f"resid_post.{LAYER}": Zero(positions=-1)}
    batch = run_with_cache(model, tokens, ["logits"], edits=edit)
    for row, text in enumerate(["a short one", "a somewhat longer prompt"]):
        solo = run_with_cache(model, model.to_tokens(text), ["logits"], edits=edit)["logits"][0]
        n = solo.shape[0]
        assert_near(batch["logits"][row, :n], solo, f"row {row}", 1e-5)


def test_function_edit_and_gradients(tiny_path):
    model = load_model(str(tiny_path("llama")), backend="eager", requires_grad=True, **load_kwargs())
    tokens = model.to_tokens(PROMPT)
    seen = []

    def double(tensor, address):
        seen.append(str(address))
        return 2 * tensor

    a = run_with_cache(model, tokens, ["logits"], edits={"mlp_out.0": double})
    b = run_with_cache(model, tokens, ["logits"], edits={"mlp_out.0": Scale(2.0)})
    assert seen == ["mlp_out.0"] and torch.equal(a["logits"], b["logits"])
    # attribution patching: the gradient of a logit with respect to an added vector
    vector = torch.zeros(model.d_model, requires_grad=True, device=model.device)
    address = f"resid_post.{LAYER}"
    cache = run_with_cache(model, tokens, ["logits", address], detach=False,
                           edits={address: lambda t, a: t + vector})
    cache["logits"][0, -1, 5].backward()
    assert vector.grad is not None and vector.grad.abs().sum() > 0
    # Add's vector is data (copied at the call): gradients flow to the activations it is added to
    captured = run_with_cache(model, tokens, ["logits", f"resid_pre.{LAYER}"], detach=False,
                              edits={address: Add(torch.ones(model.d_model))})
    resid = captured[f"resid_pre.{LAYER}"]
    (grad,) = torch.autograd.grad(captured["logits"][0, -1, 5], resid)
    assert grad.abs().sum() > 0


def test_generation_steering_changes_tokens_at_every_step(model, tokens):
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    plain, _ = capture_generation(model, tokens, ["logits"], max_tokens=6)
    steered, cache = capture_generation(model, tokens, ["logits"], max_tokens=6,
                                        edits={f"resid_post.{LAYER}": Add(vector, scale=20.0)})
    assert steered.token_ids != plain.token_ids
    # the same edit on the whole fed sequence in one forward gives the same logits
    fed = cache.tokens
    again = run_with_cache(model, fed, ["logits"], edits={f"resid_post.{LAYER}": Add(vector, scale=20.0)})
    assert_near(cache["logits"], again["logits"], "generation vs one forward", 1e-5)
    generated = {f"resid_post.{LAYER}": Add(vector, scale=20.0, positions="generated")}
    only_new, _ = capture_generation(model, tokens, ["logits"], max_tokens=6, edits=generated)
    assert only_new.token_ids[0] == plain.token_ids[0]  # the prompt is not steered


def test_kv_edits_persist_in_the_cache(model, tokens):
    for edit in ({f"k.{LAYER}": Scale(3.0, positions=[1, 2])}, {f"v.{LAYER}": Add(torch.ones(64), positions=[0])},
                 {"v.0": Scale(3.0)}):
        completion, cache = capture_generation(model, tokens, ["logits"], max_tokens=4, stop_at_eos=False, edits=edit)
        again = run_with_cache(model, cache.tokens, ["logits"], edits=edit)
        assert_near(cache["logits"], again["logits"], f"{list(edit)} with a KV cache", 1e-5)


@pytest.mark.parametrize("edits, error, words", [
    ({"resid_pst.1": Zero()}, AddressError, "known sites"),
    ({"resid_post.9": Zero()}, AddressError, "layer"),
    ({"router_logits.1": Zero()}, AddressError, "writable sites of this model there: resid_pre, attn_out, attn_out_post"),
    ({"logits": Zero()}, AddressError, "'logits' cannot be edited"),
    ({"resid_post": Zero()}, AddressError, "one layer's address"),
    ({"resid_post.1": Add(torch.zeros(7))}, InputError, "[128]"),
    ({"z.1": Set(torch.zeros(5, 64))}, InputError, "[4, 64]"),
    ({"resid_post.1": Zero(positions=[40])}, InputError, "out of range"),
    ({"resid_post.1": Zero(positions="generated")}, InputError, "generated"),
    ({"resid_post.1": Zero(heads=[0])}, InputError, "per-head sites"),
    ({"z.1": Zero(heads=[4])}, InputError, "valid: 0..3"),
    ({"k.1": Zero(heads=[2])}, InputError, "valid: 0..1"),
    ({"resid_post.1": "zero"}, InputError, "not an edit"),
    ({"resid_post.1": Scale("big")}, InputError, "factor"),
    (["resid_post.1"], InputError, "dict"),
])
def test_bad_edits_are_clear_errors_and_the_model_keeps_serving(model, tokens, edits, error, words):
    before = run_with_cache(model, tokens, ["logits", "resid_post.2"])
    with pytest.raises(error, match=".*" + __import__("re").escape(words)):
        run_with_cache(model, tokens, ["logits"], edits=edits)
    after = run_with_cache(model, tokens, ["logits", "resid_post.2"])
    assert torch.equal(after["logits"], before["logits"]) and torch.equal(after["resid_post.2"], before["resid_post.2"])


def test_function_edit_of_the_wrong_shape_is_a_clear_error(model, tokens):
    before = run_with_cache(model, tokens, ["logits", "mlp_out.0"])
    with pytest.raises(InputError, match="must return a tensor of shape"):
        run_with_cache(model, tokens, ["logits"], edits={"mlp_out.0": lambda t, a: t[:, :1]})
    after = run_with_cache(model, tokens, ["logits", "mlp_out.0"])  # no hook or edit left behind
    assert torch.equal(after["logits"], before["logits"]) and torch.equal(after["mlp_out.0"], before["mlp_out.0"])


def test_gemma2_sites_through_the_same_table(eager_models):
    """Gemma 2 normalises each block's output: resid_mid is written through attn_out_post (the norm's
    output) and still satisfies resid_mid = resid_pre + attn_out_post after the edit."""
    model = eager_models("gemma2")
    tokens = model.to_tokens(PROMPT)
    points = [f"resid_pre.{LAYER}", f"attn_out_post.{LAYER}", f"resid_mid.{LAYER}"]
    cache = run_with_cache(model, tokens, points, edits={f"resid_mid.{LAYER}": Scale(2.0)})
    plain = run_with_cache(model, tokens, [f"resid_mid.{LAYER}"])
    assert_near(cache[f"resid_mid.{LAYER}"], 2 * plain[f"resid_mid.{LAYER}"], "gemma2 resid_mid", 1e-6)
    assert_near(cache[f"resid_pre.{LAYER}"] + cache[f"attn_out_post.{LAYER}"], cache[f"resid_mid.{LAYER}"],
                "resid_mid identity after the edit", 1e-6)


#: how each multi-stream family lays out its layer output (written out here, not read from the table)
STREAM_LAYOUT = {"deepseek_v4": "b p s d", "hy_v4": "b p s d", "qwen4_exp": "b p (s d)", "gemma3n": "s b p d"}


@pytest.mark.parametrize("family", list(STREAM_LAYOUT))
def test_resid_streams_edit_equals_hand_written_hook(family, tmp_path):
    from .. import tiny_moe

    model = load_model(str(tiny_moe.build(family, tmp_path)), backend="eager", **load_kwargs())
    tokens = model.to_tokens(PROMPT)
    stream = model.info.n_streams - 1
    vector = on(model, torch.randn(model.d_model, generator=torch.Generator().manual_seed(4)))

    def by_hand(module, args, output):
        t = output[0] if isinstance(output, tuple) else output
        t = t.clone()
        layout = STREAM_LAYOUT[family]
        if layout == "b p s d":
            t[:, :, stream, :] += 3.0 * vector
        elif layout == "s b p d":
            t[stream] += 3.0 * vector
        else:
            d = t.shape[-1] // model.info.n_streams
            t[..., stream * d:(stream + 1) * d] += 3.0 * vector
        return (t, *output[1:]) if isinstance(output, tuple) else t

    handle = model.hf.get_submodule(model.arch.layers)[LAYER].register_forward_hook(by_hand)
    try:
        with torch.no_grad():
            want = model.hf(input_ids=on(model, tokens), use_cache=False).logits
    finally:
        handle.remove()
    address = f"resid_streams.{LAYER}.{stream}"
    got = run_with_cache(model, tokens, ["logits", address], edits={address: Add(vector, scale=3.0)})
    plain = run_with_cache(model, tokens, ["logits", address])
    assert not torch.allclose(got["logits"], plain["logits"])
    assert_near(got["logits"], want, f"{family} {address}", 1e-5)
    assert_near(got[address], plain[address] + 3.0 * vector, f"{family} {address} captured after the edit", 1e-6)


def test_async_capture_takes_edits(model, tokens):
    import asyncio

    edits = {f"z.{LAYER}": Zero(heads=[0]), "mlp_out.0": Scale(2.0, positions=[-1])}
    got = asyncio.run(model.capture(tokens, ["logits"], edits=edits))
    want = run_with_cache(model, tokens, ["logits"], edits=edits)
    assert torch.equal(next(iter(got.values())), want["logits"])
    completion, cache = asyncio.run(model.capture_generation_async(tokens, ["logits"], max_tokens=3, edits=edits))
    again, _ = capture_generation(model, tokens, ["logits"], max_tokens=3, edits=edits)
    assert completion.token_ids == again.token_ids
