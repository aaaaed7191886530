"""The two engines' vocabularies side by side, for bench/peer_points.py: which of our names each
of the peer's point names is, and the names both engines use for different tensors on purpose.

A peer point is compared with ours under the same name where we have it, else under its alias
(:data:`ALIASES`); a layout that differs only in how the trailing axes are split (our heads
``[b, p, h, d]``, the peer's flat ``[b, p, h·d]``) is compared reshaped (:func:`fit`). Where a
:class:`Deliberate` rule applies, the two may differ, and where it names the tensor ours is
instead, ours must equal that one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

TOLERANCE = 1e-5

#: the peer's name -> our other name for the same or the closest tensor (a deliberate difference
#: says where they differ); a name of ours with a layer (``resid_pre.0``) stands for a model-level
#: point of the peer's. A peer point is compared with ours under its own name where we serve it,
#: and under this one only where the model does not serve the own name
ALIASES = {
    "attn_probs": "pattern",
    "mlp_act": "mlp_post",
    "value": "v",
    "lm_head": "logits",
    "embeddings": "resid_pre.0",  # the peer's is model-level: ours at layer 0
    "q_norm_out": "q",
    "k_norm_out": "k",
}


@dataclasses.dataclass(frozen=True)
class Context:
    """What a deliberate difference's predicates read: the family's config, the peer's tensors
    (address string -> tensor) and the peer address being compared."""

    config: dict
    peer: dict
    address: str


def _softcapped(ctx: Context):
    cap = ctx.config["final_logit_softcapping"]
    return cap * (ctx.peer[ctx.address] / cap).tanh()


@dataclasses.dataclass(frozen=True)
class Deliberate:
    """A peer point and a name of ours (``ours``: the same name where empty) that are different
    tensors on purpose: where ``applies``, they may differ; ``ours_is`` (optional) is the
    peer-side tensor ours must equal there."""

    name: str
    ours: str
    why: str
    applies: Callable[[Context], bool]
    ours_is: Callable[[Context], object] | None = None
    ours_is_called: str = ""


#: The known definitional differences (DESIGN.md §9, issue 37). A listed difference that stops
#: differing fails the run as STALE, so this table cannot outlive the code it describes.
DELIBERATE = (
    Deliberate("lm_head", "logits",
               "the peer's lm_head is the unembedding's output before the final logit softcap; our logits are "
               "the model's output, after it",
               applies=lambda ctx: bool(ctx.config.get("final_logit_softcapping")),
               ours_is=_softcapped, ours_is_called="cap·tanh(the peer's lm_head / cap)"),
    Deliberate("embeddings", "resid_pre",
               "the peer's embeddings is the token embedding alone; our resid_pre.0 is the residual entering "
               "layer 0, with the learned position embeddings added",
               applies=lambda ctx: ctx.config.get("model_type") == "gpt2"),
    Deliberate("final_norm", "final_norm",
               "the peer's final_norm on Qwen4-Exp is the first module named norm under the trunk, layer 0's "
               "linear-attention gated norm ([b·p·heads, d_head]); ours is the model's final norm, its "
               "hyper_connection_mixer, whose output lm_head reads",
               applies=lambda ctx: ctx.config.get("model_type") == "qwen4_exp_text"),
    Deliberate("q_norm_out", "q",
               "the peer's q_norm_out is the query after its qk-norm and before rotary; our q is after rotary "
               "(the query the scores are taken from)", applies=lambda ctx: True),
    Deliberate("k_norm_out", "k",
               "the peer's k_norm_out is the key after its qk-norm and before rotary; our k is after rotary "
               "(the key the scores are taken from)", applies=lambda ctx: True),
)
DELIBERATE_BY_PAIR = {(d.name, d.ours): d for d in DELIBERATE}


def our_addresses(peer_address: str, our_sites, served=None) -> list[tuple[str, int | None]]:
    """Our (site, layer) pairs to compare a peer address with: its own name where we have it, then
    its alias where we have that and the model does not serve the own name (``served``: the site
    names the model serves; all of ``our_sites`` where not given); empty when we have neither."""
    name, _, layer = peer_address.partition(".")
    out = []
    own_served = name in (our_sites if served is None else served)
    for candidate in (name, "" if own_served else ALIASES.get(name, "")):
        ours, _, fixed = candidate.partition(".")
        if ours in our_sites:
            at = fixed or layer
            out.append((ours, int(at) if at else None))
    return out


#: our names that some peer name is an alias of
SITES_ALIASED_FROM = {ours.partition(".")[0]: peer for peer, ours in ALIASES.items()}


def fit(ours, shape):
    """``ours`` in the peer's layout: the same tensor, or reshaped where only the trailing axes'
    split differs (our heads ``[b, p, h, d]``, the peer's flat ``[b, p, h·d]``); None otherwise."""
    if tuple(ours.shape) == tuple(shape):
        return ours
    if ours.numel() == shape.numel() and tuple(ours.shape[:2]) == tuple(shape[:2]):
        return ours.reshape(shape)
    return None


def judge(peer_address: str, our_site: str, ours, want, ctx: Context) -> tuple[str, float, str]:
    """(outcome, relative error, note) for one peer address against ours (at ``our_site``)."""
    from interp_engine import relative_error

    rule = DELIBERATE_BY_PAIR.get((peer_address.partition(".")[0], our_site))
    got = fit(ours, want.shape)
    if got is None:
        shapes = f"ours {tuple(ours.shape)}, the peer's {tuple(want.shape)}"
        if rule is not None and rule.applies(ctx):
            return "deliberate", float("inf"), f"{rule.why} ({shapes})"
        return "SHAPE", float("inf"), shapes
    error = relative_error(got, want)
    if rule is None or not rule.applies(ctx):
        return ("agrees" if error <= TOLERANCE else "DIFFERS"), error, ""
    if error <= TOLERANCE:
        return "STALE", error, f"listed as a deliberate difference but agrees: mend DELIBERATE ({rule.why})"
    note = rule.why
    if rule.ours_is is not None:
        twin = rule.ours_is(ctx)
        twin_error = relative_error(got, twin)
        if twin_error > TOLERANCE:
            return "DIFFERS", error, f"{note}; yet ours differs from {rule.ours_is_called} too ({twin_error:.1e})"
        note += f"; ours equals {rule.ours_is_called} ({twin_error:.1e})"
    return "deliberate", error, note
