"""The two record types of a family's site table: :class:`Hook` (which module of a decoder layer
to read for a site, and how) and :class:`Arch` (a family: its model types, site table and where
its layers, final norm and unembedding live)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hook:
    """Read the input (``"in"``) or the output (``"out"``) of ``module`` inside a decoder layer.

    ``module`` is a dotted path relative to the layer; ``""`` is the layer itself.
    ``"attention"`` reads the attention function's arguments/results (q, k, v, pattern).
    ``index`` picks the element of a tuple output (a router returns logits, weights, indices).
    ``layout`` says how the tensor is laid out when it is not ``[batch, pos, ...]``: one of
    ``LAYOUTS`` (the recorder turns each into ``[batch, pos, ...]``, picking the stream).
    """

    module: str
    kind: str  # "in" | "out" | "attention"
    index: int = 0
    layout: str = ""


#: tensor layouts a hook may read; b batch, p position, s stream, d features
LAYOUTS = ("", "(b p) ...", "b p s d", "s b p d", "b p (s d)")


@dataclasses.dataclass(frozen=True)
class Arch:
    family: str
    model_types: tuple[str, ...]
    sites: dict[str, Hook]
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    unembed: str = "lm_head"
    attention: str = "self_attn"
    o_proj: str = "self_attn.o_proj"
    #: config attribute holding the number of residual streams ("" for a single stream)
    streams_config: str = ""
