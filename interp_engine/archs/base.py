"""The two record types of a family's site table: :class:`Hook` (which module of a decoder layer
to read for a site, and how) and :class:`Arch` (a family: its model types, its site tables and
where its layers, final norm and unembedding live), and the grouping of requested addresses by
the hook that reads them, which every backend's recorder uses."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from ..errors import InternalError


@dataclasses.dataclass(frozen=True)
class Hook:
    """Read the input (``"in"``) or the output (``"out"``) of ``module`` inside a decoder layer.

    ``module`` is a dotted path relative to the layer; ``""`` is the layer itself.
    ``"attention"`` reads the attention function's arguments/results (q, k, v, pattern; eager).
    ``"select"`` reads the expert selection of the MoE runner at ``module`` (vLLM,
    :mod:`interp_engine.backends.vllm_moe`).
    ``index`` picks the element of a tuple output (a router returns logits, weights, indices).
    ``parts`` (vLLM) names the tensors whose *sum* is the site: forward arguments by parameter
    name for ``"in"``, output elements by index for ``"out"`` / ``"select"``; a part that is
    ``None`` at run time (layer 0's residual) is skipped. vLLM's layers fuse the residual add
    into the next norm, so its residual is a sum it never materialises.
    ``shard`` (tensor parallelism) says how ranks hold it: ``""`` identical on every rank,
    ``"heads"`` / ``"cols"`` a contiguous block per rank, ``"kv"`` kv heads, possibly replicated.
    ``layout`` says how the tensor is laid out when it is not ``[batch, pos, ...]``: one of
    ``LAYOUTS`` (the recorder turns each into ``[batch, pos, ...]``, picking the stream).
    """

    module: str
    phase: str  # "in" | "out" | "attention" | "select"
    index: int = 0
    layout: str = ""
    parts: tuple = ()
    shard: str = ""


#: tensor layouts a hook may read; b batch, p position, s stream, d features; ``(b p)`` is the
#: flattened tokens (vLLM's flat batch is always that: its recorder reads rows of it)
LAYOUTS = ("", "(b p) ...", "b p s d", "s b p d", "b p (s d)", "s (b p) d")

#: the model-level site, computed from the final hidden states (not read from a layer)
LOGITS = "logits"

#: (layer, module path, phase): one hook, and the addresses read there
Group = tuple[int, str, str]


def group_sites(addresses, table: dict[str, Hook]) -> dict[Group, list]:
    """The per-layer ``addresses`` grouped by the hook of ``table`` that reads them, in order."""
    groups: dict[Group, list] = defaultdict(list)
    for address in addresses:
        if address.layer is None:
            continue
        hook = table.get(address.name)
        if hook is None:
            raise InternalError(f"[Internal] the site table has no entry for {address.name!r}")
        groups[(address.layer, hook.module, hook.phase)].append(address)
    return dict(groups)


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
    #: where the vLLM backend reads each site it serves (empty: not served on vLLM). vLLM's
    #: decoder layers fuse the residual add into the next norm, so most of its reads differ
    #: (see :mod:`interp_engine.archs.vllm_reads`)
    vllm: dict[str, Hook] = dataclasses.field(default_factory=dict)
