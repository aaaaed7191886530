"""Family records of GPT-2 and GPT-NeoX (Pythia), on both backends.

**GPT-2** (``transformer.h``): pre-norm blocks ``ln_1 -> attn -> + -> ln_2 -> mlp -> +`` with
learned position embeddings added before layer 0 (so ``resid_pre.0`` is token plus position
embedding), biases everywhere and a LayerNorm ``ln_f`` before the unembedding. Its projections are
``Conv1D`` modules, whose weights are stored ``[in, out]``, the transpose of ``nn.Linear``
(``weights="in_out"``): every reader of a projection weight goes through
:meth:`~.base.Arch.linear_weight`. vLLM's GPT-2 transposes them when it loads them, so its weights
are ``[out, in]`` like every other vLLM projection; its block is not fused (a layer returns the
new residual), so each vLLM read is one tensor.

**GPT-NeoX** (``gpt_neox.layers``): with ``use_parallel_residual=True`` (Pythia) attention and the
MLP both read ``resid_pre`` (through their own norms) and the layer returns ``resid_pre +
attn_out + mlp_out``; no residual stream exists between the two blocks, so ``resid_mid`` is
refused with that reason. With ``use_parallel_residual=False`` it is an ordinary sequential block
and ``resid_mid`` is the input of ``post_attention_layernorm``. The rotary embedding covers the
first ``rotary_pct`` of each head (``q`` / ``k`` are read after it, as everywhere). vLLM 0.32
runs GPT-NeoX through its Transformers backend: the Hugging Face decoder modules inside vLLM,
under ``model`` instead of ``gpt_neox``, on ``[1, tokens, ...]`` tensors (a batch of one around
vLLM's flat batch), with vLLM's linear layers and attention kernel swapped in.
"""

from __future__ import annotations

from .base import ONE, Arch, Hook

_ATTENTION_SITES = ("q", "k", "v", "pattern")

#: GPT-2's and GPT-NeoX's MLPs are not gated: one input projection, then the activation
_NOT_GATED = {"mlp_pre_linear": "this family's MLP is not gated: its one input projection's output is mlp_pre "
                                "(act(mlp_pre) = mlp_post)"}

GPT2_SITES = {
    "resid_pre": Hook("", "in"),
    "attn_in": Hook("attn", "in"),
    "mlp_in": Hook("mlp", "in"),
    "ln1_normalized": Hook("ln_1", "normalized"),
    "ln2_normalized": Hook("ln_2", "normalized"),
    "mlp_pre": Hook("mlp.c_fc", "out"),
    "attn_out": Hook("attn", "out"),
    "resid_mid": Hook("ln_2", "in"),
    "mlp_out": Hook("mlp", "out"),
    "resid_post": Hook("", "out"),
    "z": Hook("attn.c_proj", "in"),
    "mlp_post": Hook("mlp.c_proj", "in"),
    "resid_streams": Hook("", "out"),
    **{name: Hook("attn", "attention") for name in _ATTENTION_SITES},
}

#: vLLM's GPT2Block: ``layer(hidden_states) -> hidden_states`` (no fused add); ``ln_2`` is vLLM's
#: ``LayerNorm`` custom op, whose forward takes ``*args``: its input is positional argument 0.
GPT2_VLLM = {
    "resid_pre": Hook("", "in", parts=("hidden_states",)),
    "attn_out": Hook("attn", "out", parts=(0,)),
    "resid_mid": Hook("ln_2", "in", parts=(0,)),
    "mlp_out": Hook("mlp", "out", parts=(0,)),
    "resid_post": Hook("", "out", parts=(0,)),
    "z": Hook("attn.c_proj", "in", parts=("input_",), shard="heads"),
    "mlp_post": Hook("mlp.c_proj", "in", parts=("input_",), shard="cols"),
    "q": Hook("attn.attn", "in", parts=("query",), shard="heads"),
    "k": Hook("attn.attn", "in", parts=("key",), shard="kv"),
    "v": Hook("attn.attn", "in", parts=("value",), shard="kv"),
}

_GPT2_SCORES = {"attn_scores": "GPT-2's attention scales its scores its own way (scale_attn_weights, "
                                "scale_attn_by_inverse_layer_idx) inside its attention function, which this engine "
                                "does not reform; pattern is served"}

NEOX_PARALLEL_SITES = {
    "attn_scores": Hook("attention", "attention"),
    "resid_pre": Hook("", "in"),
    "attn_in": Hook("attention", "in"),
    "mlp_in": Hook("mlp", "in"),
    "ln1_normalized": Hook("input_layernorm", "normalized"),
    "ln2_normalized": Hook("post_attention_layernorm", "normalized"),
    "mlp_pre": Hook("mlp.dense_h_to_4h", "out"),
    "attn_out": Hook("attention", "out"),
    "mlp_out": Hook("mlp", "out"),
    "resid_post": Hook("", "out"),
    "z": Hook("attention.dense", "in"),
    "mlp_post": Hook("mlp.dense_4h_to_h", "in"),
    "resid_streams": Hook("", "out"),
    **{name: Hook("attention", "attention") for name in _ATTENTION_SITES},
}

NEOX_SEQUENTIAL_SITES = {**NEOX_PARALLEL_SITES, "resid_mid": Hook("post_attention_layernorm", "in")}

NEOX_PARALLEL_VLLM = {
    "resid_pre": Hook("", "in", parts=("hidden_states",), layout=ONE),
    "attn_out": Hook("attention", "out", parts=(0,), layout=ONE),
    "mlp_out": Hook("mlp", "out", parts=(0,), layout=ONE),
    "resid_post": Hook("", "out", parts=(0,), layout=ONE),
    "z": Hook("attention.dense", "in", parts=("input_",), shard="heads", layout=ONE),
    "mlp_post": Hook("mlp.dense_4h_to_h", "in", parts=("input_",), shard="cols", layout=ONE),
}

NEOX_SEQUENTIAL_VLLM = {**NEOX_PARALLEL_VLLM,
                        "resid_mid": Hook("post_attention_layernorm", "in", parts=(0,), layout=ONE)}

NO_RESID_MID = (
    "with use_parallel_residual=True attention and the MLP both read resid_pre, so no residual stream exists "
    "between them; resid_post = resid_pre + attn_out + mlp_out"
)

#: why vLLM's Transformers backend cannot serve q / k / v
NO_QKV_ON_TRANSFORMERS_BACKEND = (
    "vLLM runs this family through its Transformers backend, which calls its attention kernel's forward "
    "directly (no module call that a hook sees carries q, k and v); capture them on backend='eager'"
)

_NEOX = dict(
    layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm", embed="gpt_neox.embed_in",
    attention="attention", o_proj="attention.dense", vllm_attention="attention.attn",
    vllm_paths={"layers": "model.layers", "final_norm": "model.final_layer_norm", "embed": "model.embed_in"},
    vllm_refused={name: NO_QKV_ON_TRANSFORMERS_BACKEND for name in ("q", "k", "v")}, vllm_transformers_backend=True,
    d_head_from=(), n_kv_heads_from=(),
)

ARCHS = (
    Arch("gpt2", ("gpt2",), GPT2_SITES, layers="transformer.h", final_norm="transformer.ln_f",
         embed="transformer.wte", attention="attn", o_proj="attn.c_proj", weights="in_out",
         vllm=GPT2_VLLM, vllm_attention="attn.attn", d_mlp_from=("n_inner",), d_mlp_ratio=4,
         refused={**_NOT_GATED, **_GPT2_SCORES},
         d_head_from=(), n_kv_heads_from=(),
         # the record reads q / k / v through the attention interface and knows one decoder only
         matches=lambda c: not c.reorder_and_upcast_attn and not c.add_cross_attention),
    Arch("gpt_neox", ("gpt_neox",), NEOX_PARALLEL_SITES, vllm=NEOX_PARALLEL_VLLM,
         refused={"resid_mid": NO_RESID_MID, **_NOT_GATED}, matches=lambda c: c.use_parallel_residual, **_NEOX),
    Arch("gpt_neox_sequential", ("gpt_neox",), NEOX_SEQUENTIAL_SITES, vllm=NEOX_SEQUENTIAL_VLLM, refused=_NOT_GATED,
         matches=lambda c: not c.use_parallel_residual, **_NEOX),
)
