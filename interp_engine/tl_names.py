"""TransformerLens hook names, read as addresses and written from them.

A researcher coming from TransformerLens names a point ``"blocks.10.hook_resid_post"``; here it
is ``resid_post.10``. This module is the one table between the two grammars:
:func:`interp_engine.parse_address` reads a TransformerLens name through :func:`from_tl_name`
(so TL names work wherever an address does: points, cache lookups, edits), and
``format_address(a, style="tl")`` writes one through :func:`tl_name`. The dataset export for
SAELens names its column with the same table.

Only names whose tensor is exactly ours are in the table. TransformerLens's block-level
``hook_attn_out`` / ``hook_mlp_out`` are what each block adds to the residual, after any post-block
norm: our ``attn_out_post`` / ``mlp_out_post``; its bridge's ``attn.hook_out`` / ``mlp.hook_out`` are
the blocks' raw outputs, our ``attn_out`` / ``mlp_out`` (the same tensors except on Gemma 2 / 3 / 3n
and OLMo 2 / 3, which norm each block's output before the add). TransformerLens's ``hook_q`` / ``hook_k``
are *before* rotary, ours after (``hook_rot_q`` / ``hook_rot_k``), so they are not the same point;
names with no equivalent (the norms' scales, ``hook_attn_scores``, ``hook_result``) are refused
with the closest address this engine serves and how to get what the name meant. A norm's
``hook_normalized`` is its output *before* its gain (``ln1_normalized`` / ``ln2_normalized`` /
``ln_final_normalized``), not what the next block is handed (``attn_in`` / ``mlp_in`` /
``final_norm``: after the gain); SAEs and transcoders trained on one read the wrong tensor from
the other.

``model.cfg`` (:class:`TLConfig`) gives the model's facts under TransformerLens's config names.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from .errors import AddressError

#: our site name -> the TransformerLens hook name (``{L}``: the layer)
TL_HOOKS: dict[str, str] = {
    "resid_pre": "blocks.{L}.hook_resid_pre",
    "attn_out": "blocks.{L}.attn.hook_out",
    "attn_out_post": "blocks.{L}.hook_attn_out",
    "resid_mid": "blocks.{L}.hook_resid_mid",
    "mlp_out": "blocks.{L}.mlp.hook_out",
    "mlp_out_post": "blocks.{L}.hook_mlp_out",
    "resid_post": "blocks.{L}.hook_resid_post",
    "z": "blocks.{L}.attn.hook_z",
    "q": "blocks.{L}.attn.hook_rot_q",
    "k": "blocks.{L}.attn.hook_rot_k",
    "v": "blocks.{L}.attn.hook_v",
    "pattern": "blocks.{L}.attn.hook_pattern",
    "mlp_post": "blocks.{L}.mlp.hook_post",
    "expert_weights": "blocks.{L}.mlp.hook_expert_weights",
    "expert_indices": "blocks.{L}.mlp.hook_expert_indices",
    "attn_in": "blocks.{L}.attn.hook_in",
    "mlp_in": "blocks.{L}.mlp.hook_in",
    "ln1_normalized": "blocks.{L}.ln1.hook_normalized",
    "ln2_normalized": "blocks.{L}.ln2.hook_normalized",
    "mlp_pre": "blocks.{L}.mlp.hook_pre",
    "mlp_pre_linear": "blocks.{L}.mlp.hook_pre_linear",
    "ln_final_normalized": "ln_final.hook_normalized",
    **{f"{x}_norm_{io}": f"blocks.{{L}}.attn.{x}_norm.hook_{io}" for x in "qk" for io in ("in", "out")},
    "final_norm": "ln_final.hook_out",
}

#: TransformerLens names with no exact equivalent here -> (the closest site, what to do instead)
CLOSEST: dict[str, tuple[str, str]] = {
    "hook_embed": ("embeddings", "embeddings is the embedding module's output, TransformerLens's hook_embed except "
                                 "where the module scales itself (Gemma's embeddings are times sqrt(d_model) there); "
                                 "resid_pre.0 is what enters layer 0"),
    "hook_pos_embed": ("resid_pre", "these models have no positional embedding (rotary is inside attention); "
                                    "the stream after the embedding is resid_pre.0"),
    "blocks.{L}.attn.hook_q": ("q", "q.{L} is the queries after qk-norm and rotary (TransformerLens's "
                                    "blocks.{L}.attn.hook_rot_q); the pre-rotary queries are not a point here"),
    "blocks.{L}.attn.hook_k": ("k", "k.{L} is the keys after qk-norm and rotary (TransformerLens's "
                                    "blocks.{L}.attn.hook_rot_k); the pre-rotary keys are not a point here"),
    "blocks.{L}.attn.hook_attn_scores": ("attn_scores", "attn_scores.{L} is the same scores except where a query "
                                                        "cannot see a key: the dtype's minimum there, -inf in "
                                                        "TransformerLens (both softmax to zero)"),
    "blocks.{L}.attn.hook_result": ("z", "capture z.{L} and call head_contributions(model, cache, {L}) for "
                                         "each head's output through the output projection"),
    "blocks.{L}.hook_attn_in": ("resid_pre", "TransformerLens's hook_attn_in is resid_pre.{L} repeated per head; "
                                             "what attention is handed (after its norm) is attn_in.{L}"),
    "blocks.{L}.hook_q_input": ("resid_pre", "attention reads resid_pre.{L} (through its norm)"),
    "blocks.{L}.hook_k_input": ("resid_pre", "attention reads resid_pre.{L} (through its norm)"),
    "blocks.{L}.hook_v_input": ("resid_pre", "attention reads resid_pre.{L} (through its norm)"),
    "blocks.{L}.hook_mlp_in": ("resid_mid", "TransformerLens's hook_mlp_in is the residual before the MLP's norm, "
                                            "resid_mid.{L}; what the MLP is handed (after it) is mlp_in.{L}"),
    "blocks.{L}.ln1.hook_scale": ("resid_pre", "the norm's input is resid_pre.{L}; its scale is not a point"),
    "blocks.{L}.ln2.hook_scale": ("resid_mid", "the norm's input is resid_mid.{L}; its scale is not a point"),
    "ln_final.hook_scale": ("final_norm", "final_norm is the final norm's output; its scale is not a point"),
}

_BLOCK = re.compile(r"^blocks\.(-?\d+)\.(.+)$")
#: hook suffix after ``blocks.L.`` -> our site
_FROM_SUFFIX = {t.split("{L}.", 1)[1]: name for name, t in TL_HOOKS.items() if "{L}" in t}
_FROM_GLOBAL = {t: name for name, t in TL_HOOKS.items() if "{L}" not in t}


def is_tl_name(text: str) -> bool:
    """Whether ``text`` is written in TransformerLens's grammar (``blocks.L....``, ``hook_...``,
    ``ln_final....``) rather than ours."""
    return text.startswith(("blocks.", "hook_", "ln_final.", "unembed.", "embed."))


def from_tl_name(text: str) -> tuple[str, int | None]:
    """``"blocks.10.hook_resid_post"`` -> ``("resid_post", 10)``, the site and layer that
    :func:`interp_engine.parse_address` makes its address of; a name with no exact equivalent is an
    :class:`AddressError` naming the closest address (negative layers are kept: they count from
    the end once the model is known)."""
    text = text.strip()
    if text in _FROM_GLOBAL:
        return _FROM_GLOBAL[text], None
    match = _BLOCK.match(text)
    if match and match.group(2) in _FROM_SUFFIX:
        return _FROM_SUFFIX[match.group(2)], int(match.group(1))
    layer = match.group(1) if match else "0"
    template = f"blocks.{{L}}.{match.group(2)}" if match else text
    if template in CLOSEST:
        site, why = CLOSEST[template]
        raise AddressError(f"TransformerLens's {text!r} has no exact equivalent here; the closest is "
                           f"{_at(site, layer)!r}: {why.format(L=layer)}")
    known = list(TL_HOOKS.values()) + list(CLOSEST)
    guess = difflib.get_close_matches(template, known, n=1, cutoff=0.6)
    hint = ""
    if guess:
        ours = {t: n for n, t in TL_HOOKS.items()}
        site = ours[guess[0]] if guess[0] in ours else CLOSEST[guess[0]][0]
        exact = "here" if guess[0] in ours else "not a point here; the closest is"
        hint = f" Did you mean {guess[0].replace('{L}', layer)!r} ({exact} {_at(site, layer)!r})?"
    raise AddressError(f"{text!r} is not a TransformerLens hook name this engine knows.{hint} The names it maps "
                       f"to addresses (known: {', '.join(t.replace('{L}', 'L') for t in TL_HOOKS.values())})")


def _at(site: str, layer: str) -> str:
    """Our address of ``site`` at ``layer``, as text (a model-level site takes none)."""
    from .sites import SITES

    return f"{site}.{layer}" if SITES[site].per_layer else site


def tl_name(address) -> str:
    """The TransformerLens hook name of ``address`` (``resid_post.10`` -> ``blocks.10.hook_resid_post``);
    an :class:`AddressError` for the points TransformerLens has no hook for."""
    template = TL_HOOKS.get(address.name)
    if template is None or address.stream is not None:
        raise AddressError(f"{address.name!r} has no TransformerLens hook name; these do: "
                           f"{', '.join(TL_HOOKS)}")
    return template.format(L=address.layer)


@dataclasses.dataclass(frozen=True)
class TLConfig:
    """``model.cfg``: the model's facts under TransformerLens's ``HookedTransformerConfig`` names,
    read-only (a frozen view: the model's shape is not changed by editing it)."""

    model_name: str
    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    n_key_value_heads: int
    num_experts: int | None
    experts_per_token: int | None
    dtype: object  # a torch.dtype
    device: str | None
    original_architecture: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def tl_config(info, dtype, device, architecture: str = "") -> TLConfig:
    """``model.cfg`` of a model with these facts (:class:`~interp_engine.points.ModelInfo`)."""
    import torch

    return TLConfig(model_name=info.name.rstrip("/").rsplit("/", 1)[-1], n_layers=info.n_layers,
                    d_model=info.d_model, n_heads=info.n_heads, d_head=info.d_head, d_mlp=info.d_mlp,
                    d_vocab=info.d_vocab, n_ctx=info.n_ctx, n_key_value_heads=info.n_kv_heads,
                    num_experts=info.n_experts or None, experts_per_token=info.top_k or None,
                    dtype=getattr(torch, dtype), device=None if device is None else str(device),
                    original_architecture=architecture or info.family)
