"""Independent oracles for the family tests (tests/archs/test_family_*.py): each decoder layer's attention
and MLP written out by hand from its weights, and the shared checks every family must pass.

A family is described to the oracle by a :class:`Layout` (which norms sit where, how q / k are
normed, whether the softmax has a sink): the oracle computes ``q``, ``k``, ``v``, ``pattern``,
``z`` and ``mlp_post`` from ``resid_pre`` / ``resid_mid`` with the layer's parameters, the
family's rotary function and a mask built here (causal, plus the sliding window on sliding
layers), never through the capture code's hooks.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import torch

from interp_engine import head_contributions, run_with_cache

from ..devices import on
from ..oracles import REL_SAME, assert_near


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a family's norms sit (``None``: absent) and how its attention scores are formed."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None
    #: ``"head"``: q / k normed per head (Gemma 3); ``"all"``: over all heads before the split (OLMo 2)
    qk_norm: str | None = None
    #: a learned per-head logit joins each softmax and is dropped after it (GPT-OSS)
    sink: bool = False


def norm(block, name, x):
    return x if name is None else getattr(block, name)(x)


def _rotary(hf, x, layer: int):
    rotary = hf.model.rotary_emb
    position_ids = torch.arange(x.shape[1], device=x.device)[None]
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return rotary(x, position_ids, hf.config.layer_types[layer])
    return rotary(x, position_ids)


def manual_attention(hf, layer: int, resid_pre: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """``q``, ``k``, ``v`` as ``[b, p, heads, d]``, ``pattern`` ``[b, h, q, k]`` and ``z`` of one layer,
    from its weights (one unpadded prompt)."""
    block = hf.model.layers[layer]
    attn = block.self_attn
    x = norm(block, layout.pre_attn, resid_pre)
    b, p, _ = x.shape
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if layout.qk_norm == "all":
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)).transpose(1, 2) for t in (q, k, v))
    if layout.qk_norm == "head":
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = _rotary(hf, x, layer)
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(2, 3) * attn.scaling
    i, j = torch.arange(p, device=x.device)[:, None], torch.arange(p, device=x.device)[None]
    allowed = j <= i
    window = getattr(attn, "sliding_window", None)
    if window:
        allowed &= j > i - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if layout.sink:
        sink = attn.sinks.reshape(1, -1, 1, 1).expand(b, -1, p, 1)
        pattern = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        pattern = scores.softmax(-1)
    z = (pattern @ v.repeat_interleave(groups, 1)).transpose(1, 2)
    return {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2), "pattern": pattern, "z": z}


def manual_mlp_post(block, resid_mid: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The gated MLP's hidden activation, ``act(gate(x)) * up(x)`` with ``x`` the normed ``resid_mid``."""
    x = norm(block, layout.pre_mlp, resid_mid)
    return block.mlp.act_fn(block.mlp.gate_proj(x)) * block.mlp.up_proj(x)


DENSE = ["resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post", "resid_post", "z", "q",
         "k", "v"]


def check_residuals_against_hf(model, tokens) -> None:
    """``resid_pre.0`` and every ``resid_post.L`` but the last equal HF's ``output_hidden_states``
    (the last has the final norm applied there), and the logits equal HF's."""
    n = model.info.n_layers
    cache = run_with_cache(model, tokens, ["resid_pre.0", "resid_post", "logits"])
    with torch.no_grad():
        ref = model.hf(input_ids=on(model, tokens), output_hidden_states=True)
    assert_near(cache.get("resid_pre", 0), ref.hidden_states[0], "resid_pre.0", REL_SAME)
    for layer in range(n - 1):
        assert_near(cache.get("resid_post", layer), ref.hidden_states[layer + 1], f"resid_post.{layer}", REL_SAME)
    final = model.final_norm(cache.get("resid_post", n - 1))
    assert_near(final, ref.hidden_states[n], "final_norm(resid_post)", REL_SAME)
    assert_near(cache["logits"], ref.logits, "logits", REL_SAME)


def check_identities(model, cache) -> None:
    """``resid_mid = resid_pre + attn_out_post``, ``resid_post = resid_mid + mlp_out_post`` and
    ``resid_post.L = resid_pre.(L+1)``."""
    for layer in range(model.info.n_layers):
        pre, mid, post = (cache.get(s, layer) for s in ("resid_pre", "resid_mid", "resid_post"))
        assert_near(mid, pre + cache.get("attn_out_post", layer), f"resid_mid.{layer}", REL_SAME)
        assert_near(post, mid + cache.get("mlp_out_post", layer), f"resid_post.{layer}", REL_SAME)
        if layer + 1 < model.info.n_layers:
            assert torch.equal(post, cache.get("resid_pre", layer + 1))


def check_attention_by_hand(model, cache, layout: Layout) -> None:
    """``q``, ``k``, ``v``, ``pattern`` and ``z`` equal the attention written out from the weights;
    ``attn_out`` is ``z`` through the output projection, ``attn_out_post`` that through the
    post-attention norm where the family has one; ``head_contributions`` sum to the projection's output."""
    for layer in range(model.info.n_layers):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            want = manual_attention(model.hf, layer, cache.get("resid_pre", layer), layout)
            for site in ("q", "k", "v", "z") + (("pattern",) if f"pattern.{layer}" in map(str, cache) else ()):
                assert_near(cache.get(site, layer), want[site], f"{site}.{layer}", REL_SAME)
            o_proj = block.self_attn.o_proj
            projected = o_proj(cache.get("z", layer).flatten(-2))
            assert_near(projected, cache.get("attn_out", layer), f"attn_out.{layer}", REL_SAME)
            assert_near(norm(block, layout.post_attn, projected), cache.get("attn_out_post", layer),
                        f"attn_out_post.{layer}", REL_SAME)
            heads = head_contributions(model, cache, layer)
            bias = o_proj.bias if o_proj.bias is not None else 0
            assert_near(heads.sum(2) + bias, projected, f"head_contributions.{layer}", REL_SAME)


def check_pattern_against_hf(model, tiny_dir, tokens) -> None:
    """``pattern`` equals HF's ``output_attentions`` from the same weights loaded with eager attention."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").to(model.device)
    with torch.no_grad():
        ref = hf(input_ids=on(model, tokens), output_attentions=True).attentions
    cache = run_with_cache(model, tokens, "pattern")
    for layer in range(model.info.n_layers):
        assert_near(cache.get("pattern", layer), ref[layer], f"pattern.{layer}", REL_SAME)


def check_mlp_by_hand(model, cache, layout: Layout) -> None:
    """``mlp_post`` is the gated activation of the normed ``resid_mid``; ``mlp_out`` is it through
    the down projection, ``mlp_out_post`` that through the post-feedforward norm where the family has one."""
    for layer in range(model.info.n_layers):
        block = model.hf.model.layers[layer]
        with torch.no_grad():
            post = manual_mlp_post(block, cache.get("resid_mid", layer), layout)
            assert_near(cache.get("mlp_post", layer), post, f"mlp_post.{layer}", REL_SAME)
            out = block.mlp.down_proj(post)
            assert_near(cache.get("mlp_out", layer), out, f"mlp_out.{layer}", REL_SAME)
            assert_near(cache.get("mlp_out_post", layer), norm(block, layout.post_mlp, out), f"mlp_out_post.{layer}",
                        REL_SAME)


def check_edits_by_hand(model, tokens, attn_out_module: str) -> None:
    """Edits equal hand-written hooks on the HF model: ``Zero(heads=[1])`` on ``z.1`` is a zeroed
    slice of the output projection's input; ``Add`` on ``attn_out.1`` adds to the attention block's
    output, on ``attn_out_post.1`` to the output of the module that forms the residual contribution
    (``attn_out_module``); each changes the logits."""
    from interp_engine import Add, Zero

    d_head = model.info.d_head
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    on_device = vector.to(model.device)
    block = model.hf.model.layers[1]

    def zero_head(module, args):
        x = args[0].clone()
        x[..., d_head: 2 * d_head] = 0
        return (x, *args[1:])

    def add(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + on_device, *output[1:])
        return output + on_device

    clean = run_with_cache(model, tokens, ["logits"])["logits"]
    for edits, module, kind, hook in (
        ({"z.1": Zero(heads=[1])}, block.self_attn.o_proj, "pre", zero_head),
        ({"attn_out.1": Add(vector)}, block.self_attn, "post", add),
        ({"attn_out_post.1": Add(vector)}, block.get_submodule(attn_out_module), "post", add),
    ):
        got = run_with_cache(model, tokens, ["logits"], edits=edits)["logits"]
        handle = (module.register_forward_pre_hook(hook) if kind == "pre" else module.register_forward_hook(hook))
        try:
            with torch.no_grad():
                want = model.hf(input_ids=on(model, tokens)).logits
        finally:
            handle.remove()
        assert_near(got, want, f"logits under {edits}", REL_SAME)
        assert (got - clean).abs().max() > 1e-4, f"{edits} did not change the logits"


def check_positions(model, tokens, points) -> None:
    """``positions=[0, -1]`` keeps exactly those rows of the full capture."""
    full = run_with_cache(model, tokens, points)
    some = run_with_cache(model, tokens, points, positions=[0, -1])
    for address, tensor in full.items():
        axis = address.query_axis
        want = tensor.index_select(axis, torch.tensor([0, tensor.shape[axis] - 1], device=tensor.device))
        assert torch.equal(some[address], want), address
