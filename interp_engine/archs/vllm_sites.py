"""Where each site lives in vLLM's model classes, held as data (one table per family).

vLLM's decoder layers differ from Hugging Face's in one way that matters here: the residual add
is fused into the next norm. A layer is called as ``layer(positions, hidden_states, residual)``
and returns ``(delta, residual)``, where ``delta`` is what the layer's last block adds and
``residual`` is the stream before that add. So the residual stream is a *sum* of two tensors
that vLLM never materialises; a :class:`VllmRead` names the tensors to add.

- ``resid_pre.L`` = layer input ``hidden_states + residual`` (layer 0 has ``residual=None``: its
  input is the embedding, already scaled where the family scales it, e.g. Gemma 2).
- ``resid_post.L`` = layer output ``out[0] + out[1]``; ``mlp_out.L`` = ``out[0]``.
- ``resid_mid.L`` = the second output of the fused add-norm that follows attention.
- ``z`` / ``mlp_post`` are inputs of the row-parallel output / down projections; under tensor
  parallelism each rank holds a contiguous block of their last dimension (``sharded``).
- ``q`` / ``k`` / ``v`` are the arguments of vLLM's ``Attention`` module: after qk-norm and
  rotary, before the score scaling, exactly as the kernel uses them (``kv_sharded`` for k / v,
  whose heads may be replicated across ranks when there are fewer kv heads than ranks).

Written against vLLM 0.32.0's Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 model classes.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class VllmRead:
    """Read a site inside decoder layer ``L``: ``module`` (dotted, relative to the layer; ``""``
    is the layer), ``phase`` ``"in"`` (forward arguments, by parameter name) or ``"out"``
    (elements of the output, by index), and the ``parts`` to add together (a part that is
    ``None`` at run time, such as layer 0's residual, is skipped).

    ``shard`` says how tensor-parallel ranks hold it: ``""`` identical on every rank (read
    rank 0), ``"heads"`` / ``"cols"`` a contiguous block per rank (concatenate in rank order),
    ``"kv"`` kv heads, possibly replicated across ranks.
    """

    module: str
    phase: str  # "in" | "out" | "call" (the result of the method that ``module`` names)
    parts: tuple
    shard: str = ""
    #: ``"s t d"``: the tensor stacks the residual streams first (pick the address's stream)
    layout: str = ""


_LLAMA = {
    "resid_pre": VllmRead("", "in", ("hidden_states", "residual")),
    "attn_out": VllmRead("self_attn", "out", (0,)),
    "resid_mid": VllmRead("post_attention_layernorm", "out", (1,)),
    "mlp_out": VllmRead("", "out", (0,)),
    "resid_post": VllmRead("", "out", (0, 1)),
    "z": VllmRead("self_attn.o_proj", "in", ("input_",), shard="heads"),
    "mlp_post": VllmRead("mlp.down_proj", "in", ("input_",), shard="cols"),
    "q": VllmRead("self_attn.attn", "in", ("query",), shard="heads"),
    "k": VllmRead("self_attn.attn", "in", ("key",), shard="kv"),
    "v": VllmRead("self_attn.attn", "in", ("value",), shard="kv"),
}

#: Gemma 2 normalises each block's output before the add (post-attention / post-feedforward norms).
_GEMMA2 = {
    **_LLAMA,
    "attn_out": VllmRead("post_attention_layernorm", "out", (0,)),
    "resid_mid": VllmRead("pre_feedforward_layernorm", "out", (1,)),
}



def _moe(block: str) -> dict[str, VllmRead]:
    """MoE families with Llama's layout and their MoE block at ``block``: the gate (replicated
    on every rank) returns ``(router_logits, bias)`` over the flat tokens; the router's
    ``select_experts`` returns ``(topk_weights, topk_ids)``, the pair the expert kernel is given
    (a ``"call"`` read, see :mod:`interp_engine.backends.vllm_moe` and docs/MOE.md)."""
    select = f"{block}.experts.router.select_experts"
    return {
        **_LLAMA,
        "router_logits": VllmRead(f"{block}.gate", "out", (0,)),
        "expert_weights": VllmRead(select, "call", (0,)),
        "expert_indices": VllmRead(select, "call", (1,)),
    }

#: Gemma 3n (AltUp): a layer returns its ``altup_num_inputs`` streams stacked first,
#: ``[stream, tokens, d_model]``; the blocks' outputs are normed as in Gemma 2. The single-stream
#: residual sites are refused on multi-stream models (docs/MOE.md).
_GEMMA3N = {
    "attn_out": VllmRead("post_attention_layernorm", "out", (0,)),
    "mlp_out": VllmRead("post_feedforward_layernorm", "out", (0,)),
    # k / v are left out: vLLM's KV-shared layers call attention with no keys or values.
    **{name: _LLAMA[name] for name in ("z", "mlp_post", "q")},
    "resid_streams": VllmRead("", "out", (0,), layout="s t d"),
}

#: family (as in :mod:`interp_engine.archs`) -> site name -> where vLLM computes it
VLLM_SITES: dict[str, dict[str, VllmRead]] = {
    "llama": _LLAMA,
    "gemma2": _GEMMA2,
    "qwen3_moe": _moe("mlp"),
    "olmoe": _moe("mlp"),
    "mixtral": _moe("block_sparse_moe"),
    "gemma3n": _GEMMA3N,
}

#: the model-level site, computed from the final (normed) hidden states by the model's own
#: ``compute_logits`` (lm head, soft-capping, vocabulary gather across ranks)
LOGITS = "logits"


def vllm_sites(family: str) -> dict[str, VllmRead]:
    try:
        return VLLM_SITES[family]
    except KeyError:
        raise ValueError(
            f"the vLLM backend has no site table for family {family!r}; known: {', '.join(VLLM_SITES)}. "
            f"Use backend='eager', or add a table to interp_engine/archs/vllm_sites.py"
        ) from None
