"""The vLLM backend's reads of the site tables, as data: what each family's ``Arch.vllm`` holds.

vLLM's decoder layers differ from Hugging Face's in one way that matters here: the residual add
is fused into the next norm. A layer is called as ``layer(positions, hidden_states, residual)``
and returns ``(delta, residual)``, where ``delta`` is what the layer's last block adds and
``residual`` is the stream before that add. So the residual stream is a *sum* of two tensors
that vLLM never materialises; a :class:`~.base.Hook` names the ``parts`` to add.

- ``resid_pre.L`` = layer input ``hidden_states + residual`` (layer 0 has ``residual=None``: its
  input is the embedding, already scaled where the family scales it, e.g. Gemma 2).
- ``resid_post.L`` = layer output ``out[0] + out[1]``; ``mlp_out_post.L`` = ``out[0]`` (what the
  MLP adds; ``mlp_out`` the MLP's raw output, the same tensor where no post-feedforward norm follows).
- ``resid_mid.L`` = the second output of the fused add-norm that follows attention.
- ``z`` / ``mlp_post`` are inputs of the row-parallel output / down projections; under tensor
  parallelism each rank holds a contiguous block of their last dimension (``shard``).
- ``q`` / ``k`` / ``v`` are the arguments of vLLM's ``Attention`` module: after qk-norm and
  rotary, before the score scaling, exactly as the kernel uses them (``kv`` for k / v, whose
  heads may be replicated across ranks when there are fewer kv heads than ranks).

Module paths and parameter names follow vLLM's Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / MoE
model classes of the release :mod:`interp_engine.backends.vllm.compat` supports.
"""

from __future__ import annotations

from .base import Hook

LLAMA = {
    "resid_pre": Hook("", "in", parts=("hidden_states", "residual")),
    "attn_out": Hook("self_attn", "out", parts=(0,)),
    "resid_mid": Hook("post_attention_layernorm", "out", parts=(1,)),
    "mlp_out": Hook("", "out", parts=(0,)),
    "resid_post": Hook("", "out", parts=(0, 1)),
    "z": Hook("self_attn.o_proj", "in", parts=("input_",), shard="heads"),
    "mlp_post": Hook("mlp.down_proj", "in", parts=("input_",), shard="cols"),
    "q": Hook("self_attn.attn", "in", parts=("query",), shard="heads"),
    "k": Hook("self_attn.attn", "in", parts=("key",), shard="kv"),
    "v": Hook("self_attn.attn", "in", parts=("value",), shard="kv"),
}

#: Gemma 2 normalises each block's output before the add (post-attention / post-feedforward norms):
#: ``attn_out`` / ``mlp_out`` are the blocks' raw outputs, the ``_post`` sites the normed ones.
GEMMA2 = {
    **LLAMA,
    "attn_out_post": Hook("post_attention_layernorm", "out", parts=(0,)),
    "resid_mid": Hook("pre_feedforward_layernorm", "out", parts=(1,)),
    "mlp_out": Hook("mlp", "out", parts=(0,)),
    "mlp_out_post": Hook("", "out", parts=(0,)),
}


def moe(block: str) -> dict[str, Hook]:
    """MoE families with Llama's layout and their MoE block at ``block``: the gate (replicated
    on every rank) returns ``(router_logits, bias)`` over the flat tokens; the experts' runner
    selects ``(topk_weights, topk_ids)``, the pair the expert kernel is given (a ``"select"``
    read, see :mod:`interp_engine.backends.vllm.worker.experts` and docs/MOE.md)."""
    return {
        **LLAMA,
        "router_logits": Hook(f"{block}.gate", "out", parts=(0,)),
        "expert_weights": Hook(f"{block}.experts", "select", parts=(0,)),
        "expert_indices": Hook(f"{block}.experts", "select", parts=(1,)),
    }


#: Gemma 3n (AltUp): a layer returns its ``altup_num_inputs`` streams stacked first,
#: ``[stream, tokens, d_model]``; the blocks' outputs are normed as in Gemma 2. The single-stream
#: residual sites are refused on multi-stream models (docs/MOE.md).
GEMMA3N = {
    "attn_out": Hook("self_attn", "out", parts=(0,)),
    "attn_out_post": Hook("post_attention_layernorm", "out", parts=(0,)),
    "mlp_out": Hook("mlp", "out", parts=(0,)),
    "mlp_out_post": Hook("post_feedforward_layernorm", "out", parts=(0,)),
    # k / v are left out: vLLM's KV-shared layers call attention with no keys or values.
    **{name: LLAMA[name] for name in ("z", "mlp_post", "q")},
    "resid_streams": Hook("", "out", parts=(0,), layout="s (b p) d"),
}


_NOT_WIRED = ("not read on the vLLM backend yet (issue 37: the eager backend serves it; on vLLM {how}); "
              "load the model with backend='eager' to capture it")

#: why the vLLM backend does not serve the points the eager backend reads around each block
EAGER_ONLY = {
    "attn_in": _NOT_WIRED.format(how="the attention module's input is the fused add-norm's first output"),
    "mlp_in": _NOT_WIRED.format(how="the MLP's input is the fused add-norm's first output"),
    "ln1_normalized": _NOT_WIRED.format(how="vLLM's fused add-norm kernel never forms the norm before its gain"),
    "ln2_normalized": _NOT_WIRED.format(how="vLLM's fused add-norm kernel never forms the norm before its gain"),
    "ln_final_normalized": _NOT_WIRED.format(how="vLLM's final norm is fused with the residual add"),
    "mlp_pre": _NOT_WIRED.format(how="vLLM fuses the gate and up projections into one gate_up_proj"),
    "mlp_pre_linear": _NOT_WIRED.format(how="vLLM fuses the gate and up projections into one gate_up_proj"),
    **{f"{x}_norm_{io}": _NOT_WIRED.format(how="the q / k norms run inside vLLM's attention module") for x in "qk"
       for io in ("in", "out")},
    "embeddings": _NOT_WIRED.format(how="the embedding is vocabulary-parallel under tensor parallelism"),
    "lm_head": _NOT_WIRED.format(how="vLLM's compute_logits folds the final softcapping into the unembedding; "
                                     "logits is served"),
}
