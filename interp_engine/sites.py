"""The site table: every address name, what its tensor means and holds, as data.

One :class:`Site` per name: its shape, the coordinates it takes (a layer, a stream), which models
and backends can serve it, and which of its tensor's axes run over positions (the attention
pattern has two: queries and keys). Code that treats sites differently reads these fields
instead of testing names.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Site:
    """What one address name means: its shape, and the coordinates it takes."""

    name: str
    shape: str
    meaning: str
    per_layer: bool = True
    per_stream: bool = False
    moe: bool = False
    #: needs the attention probabilities formed, which fused kernels never do (Capabilities.forms_pattern)
    needs_pattern: bool = False
    #: only defined where the residual is one stream (see docs/MOE.md)
    single_stream: bool = False
    #: only defined on layers with a dense MLP (not on MoE layers)
    dense_mlp: bool = False
    #: read inside softmax attention: only defined on layers whose token mixer is attention (not on
    #: a hybrid model's linear-attention layers)
    attention: bool = False
    #: what to do instead where a backend cannot serve the site ({L}: the layer)
    fallback: str = ""
    #: the axes of a ``[batch, ...]`` tensor that run over positions, the query (or only) one first
    position_axes: tuple[int, ...] = (1,)
    #: the unembedding's output at every position (a forward that computes only the last
    #: position's logits does not form it)
    unembedding: bool = False
    #: a model-level site computed before the first layer (forward order lists it first)
    before_layers: bool = False
    #: why a family table without this site has none, where that is the usual reason
    absent: str = ""
    #: keys a query cannot see hold the dtype's minimum (pre-softmax scores), not zero
    masked_min: bool = False


_SELECTION = (
    "this engine forms the expert selection inside a fused kernel and exposes no call that carries it, "
    "so it cannot be read exactly here. Capture 'router_logits.{L}' and derive the assignment with "
    "expert_assignment(cache, {L}, n_experts, top_k=..., renormalize=...) (a re-derivation; see docs/MOE.md), "
    "or load the model with backend='eager' to capture the selection itself"
)

SITES: dict[str, Site] = {
    s.name: s
    for s in [
        Site("resid_pre", "[b, p, d_model]", "residual stream entering the layer", single_stream=True),
        Site("ln1_normalized", "[b, p, d_model]", "the pre-attention norm's output before its gain (and bias): "
             "TransformerLens's blocks.L.ln1.hook_normalized"),
        Site("attn_in", "[b, p, d_model]", "what the attention block is handed: the pre-attention norm's output, "
             "or resid_pre where the family has no such norm (OLMo 2 / 3)"),
        Site("attn_out", "[b, p, d_model]", "the attention block's raw output, before any post-attention norm"),
        Site("attn_out_post", "[b, p, d_model]", "what the attention block adds to the residual: attn_out after "
             "any post-attention norm (attn_out itself where the family has none)"),
        Site("resid_mid", "[b, p, d_model]", "resid_pre + attn_out_post", single_stream=True),
        Site("ln2_normalized", "[b, p, d_model]", "the pre-MLP norm's output before its gain (and bias): "
             "TransformerLens's blocks.L.ln2.hook_normalized"),
        Site("mlp_in", "[b, p, d_model]", "what the MLP / MoE block is handed: the pre-MLP norm's output, or "
             "resid_mid where the family has no such norm (OLMo 2 / 3)"),
        Site("mlp_pre", "[b, p, d_mlp]", "the MLP's pre-activation: the gate projection's output in a gated MLP, "
             "the input projection's in a plain one", dense_mlp=True),
        Site("mlp_pre_linear", "[b, p, d_mlp]", "a gated MLP's linear (up) projection output, which multiplies "
             "act(mlp_pre)", dense_mlp=True),
        Site("mlp_out", "[b, p, d_model]", "the MLP / MoE block's raw output, before any post-feedforward norm"),
        Site("mlp_out_post", "[b, p, d_model]", "what the MLP / MoE block adds to the residual: mlp_out after "
             "any post-feedforward norm (mlp_out itself where the family has none)"),
        Site("resid_post", "[b, p, d_model]", "resid_mid + mlp_out_post = resid_pre of the next layer",
             single_stream=True),
        Site("z", "[b, p, n_heads, d_head]", "per-head attention output, input of the output projection",
             attention=True),
        *(Site(f"{x}_norm_{io}", f"[b, p, {h}, d_head] or [b, p, {h} * d_head]",
               f"the {x} norm's {'input' if io == 'in' else 'output'} (before rotary), in the layout the family "
               f"applies it: per head (Qwen3, Gemma 3) or over all heads (OLMo 2 / 3)", attention=True,
               absent="this family has no qk-norm (q / k are the projections, after rotary)")
          for x, h in (("q", "n_heads"), ("k", "n_kv_heads")) for io in ("in", "out")),
        Site("q", "[b, p, n_heads, d_head]", "queries as used in the scores (after qk-norm and rotary)",
             attention=True),
        Site("k", "[b, p, n_kv_heads, d_head]", "keys as used in the scores (after qk-norm and rotary)",
             attention=True),
        Site("v", "[b, p, n_kv_heads, d_head]", "values", attention=True),
        Site("attn_scores", "[b, n_heads, q_pos, k_pos]", "pre-softmax attention scores: q k^T scaled, after any "
             "attention logit softcap, plus the mask (keys a query cannot see: the dtype's minimum)",
             needs_pattern=True, position_axes=(2, 3), attention=True, masked_min=True),
        Site("pattern", "[b, n_heads, q_pos, k_pos]", "attention probabilities", needs_pattern=True,
             position_axes=(2, 3), attention=True),
        Site("mlp_post", "[b, p, d_mlp]", "MLP hidden activation entering the down projection", dense_mlp=True),
        Site("router_logits", "[b, p, n_experts]", "MoE gate output", moe=True),
        Site("expert_weights", "[b, p, top_k]", "MoE routing weights actually used", moe=True, fallback=_SELECTION),
        Site("expert_indices", "[b, p, top_k]", "MoE experts actually selected", moe=True, fallback=_SELECTION),
        Site("resid_streams", "[b, p, d_model]", "stream S of the residual after the layer", per_stream=True),
        Site("embeddings", "[b, p, d_model]", "the token embedding module's output (before any position embedding "
             "the model adds after it, and any scale it applies outside the module)", per_layer=False,
             before_layers=True),
        Site("ln_final_normalized", "[b, p, d_model]", "the final norm's output before its gain (and bias): "
             "TransformerLens's ln_final.hook_normalized", per_layer=False),
        Site("final_norm", "[b, p, d_model]", "the final norm's output: what the unembedding reads",
             per_layer=False),
        Site("lm_head", "[b, p, vocab]", "the unembedding's output, before any final logit softcapping",
             per_layer=False, unembedding=True),
        Site("logits", "[b, p, vocab]", "final logits", per_layer=False, unembedding=True),
    ]
}

#: the model-level sites every backend serves, outside the per-family tables (the other
#: model-level sites are read from a module the family record names: ``Arch.sites``)
MODEL_LEVEL = frozenset({"final_norm", "logits"})
