"""Other engines' point names, read against ours: decoderesearch's ``interp-engine`` (the peer,
whose address contract this one shares) and the near-misses of a typing hand.

The peer names some points differently: where its tensor is exactly ours, its name is an alias
(``attn_probs`` is ``pattern``, ``mlp_act`` is ``mlp_post``: same meaning, same shape); where its
tensor differs (``value`` is flat ``[b, p, n_kv_heads * d_head]``, ours ``v`` per head) or is not
served here, its name is refused with the closest point we do serve and why. Every unknown name
gets a "did you mean" over our names, the peer's and TransformerLens's (:mod:`.tl_names`).
docs/POINTS.md tables the four vocabularies side by side.
"""

from __future__ import annotations

import difflib

from .sites import SITES

#: the peer's names whose tensor is exactly ours (same meaning, same shape) -> our name
ALIASES = {"attn_probs": "pattern", "mlp_act": "mlp_post"}

#: the peer's names we do not serve under that name -> (the closest point we serve, why)
PEER_ONLY = {
    "value": ("v", "the peer's value.L is the values flat, [b, p, n_kv_heads * d_head]; here v.L is the same numbers "
                   "per KV head, [b, p, n_kv_heads, d_head] (v.L.flatten(-2) is the peer's value.L)"),
    "attn_gate": ("z", "a gated attention's raw gate projection is not a point here; z.L is the output projection's "
                       "input, after the gate (Qwen3.5 / Qwen3-Next)"),
    **{name: ("resid_streams", "the hyper-connection internals are not points here; resid_streams.L.S is stream S "
                               "after layer L, attn_out_post / mlp_out_post what each block writes")
       for name in ("attn_stream_collapse", "mlp_stream_collapse", "attn_stream_write", "attn_stream_mix",
                    "mlp_stream_write", "mlp_stream_mix")},
}


def our_name(name: str) -> str:
    """``name`` as this engine spells it (the peer's exact synonyms read as ours)."""
    return ALIASES.get(name, name)


def unknown_site(name: str) -> str:
    """Why ``name`` is not a site here, with the closest one we serve: the message of the
    :class:`~interp_engine.errors.AddressError` that refuses it."""
    if name in PEER_ONLY:
        closest, why = PEER_ONLY[name]
        return (f"{name!r} is decoderesearch interp-engine's name for a point this engine does not serve under that "
                f"name; the closest is {closest!r}: {why}")
    from .tl_names import TL_HOOKS

    words = {**{s: s for s in SITES}, **{a: a for a in ALIASES}, **{p: p for p in PEER_ONLY},
             **{t.rsplit(".", 1)[-1]: s for s, t in TL_HOOKS.items()}}
    guess = difflib.get_close_matches(name, list(words), n=1, cutoff=0.6)
    hint = ""
    if guess:
        word = guess[0]
        if word in PEER_ONLY:
            hint = f" (did you mean {word!r}? {unknown_site(word)})"
        elif word in SITES or word in ALIASES:
            hint = f" (did you mean {word!r}?)"
        else:
            hint = f" (did you mean {words[word]!r}, TransformerLens's {word}?)"
    return f"unknown site {name!r}{hint}; known sites: {', '.join(SITES)}"
