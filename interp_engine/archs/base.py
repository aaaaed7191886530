"""The two record types of a family's site table: :class:`Hook` (which module of a decoder layer
to read for a site, and how) and :class:`Arch` (a family: its model types, its site tables and
where its layers, final norm and unembedding live), and the grouping of requested addresses by
the hook that reads them, which every backend's recorder uses."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable

from ..errors import InternalError


@dataclasses.dataclass(frozen=True)
class Hook:
    """Read the input (``"in"``) or the output (``"out"``) of ``module`` inside a decoder layer.

    ``module`` is a dotted path relative to the layer; ``""`` is the layer itself; ``"a|b"`` is
    whichever of ``a`` and ``b`` the layer has (a hybrid model's token mixer is ``self_attn`` on
    its attention layers and ``linear_attn`` on the others; see :func:`layer_module`).
    ``"attention"`` reads the attention function's arguments/results (q, k, v, pattern; eager).
    ``"select"`` reads the expert selection of the MoE runner at ``module`` (vLLM,
    :mod:`interp_engine.backends.vllm.worker.experts`).
    ``"normalized"`` reads the norm at ``module``'s output before its gain, recomputed from its
    input (eager, :mod:`interp_engine.backends.eager.norms`).
    A model-level site (``embeddings``, ``lm_head``, ``ln_final_normalized``) names a module path
    relative to the model; :class:`Arch` fills them from its ``embed``, ``unembed`` and
    ``final_norm`` paths.
    ``index`` picks the element of a tuple output (a router returns logits, weights, indices).
    ``parts`` (vLLM) names the tensors whose *sum* is the site: forward arguments by parameter
    name for ``"in"`` (by position, an int, where the forward takes ``*args``: a custom op), output
    elements by index for ``"out"`` / ``"select"``; a part that is
    ``None`` at run time (layer 0's residual) is skipped. vLLM's layers fuse the residual add
    into the next norm, so its residual is a sum it never materialises.
    ``shard`` (tensor parallelism) says how ranks hold it: ``""`` identical on every rank,
    ``"heads"`` / ``"cols"`` a contiguous block per rank, ``"kv"`` kv heads, possibly replicated.
    ``layout`` says how the tensor is laid out when it is not ``[batch, pos, ...]``: one of
    ``LAYOUTS`` (the recorder turns each into ``[batch, pos, ...]``, picking the stream).
    """

    module: str
    phase: str  # "in" | "out" | "attention" | "select" | "normalized"
    index: int = 0
    layout: str = ""
    parts: tuple = ()
    shard: str = ""


#: tensor layouts a hook may read; b batch, p position, s stream, h head, d features; ``(b p)`` is the
#: flattened tokens (vLLM's flat batch is always that: its recorder reads rows of it); ``1 (b p) ...``
#: is vLLM's flat batch inside a batch axis of one (the Hugging Face modules that vLLM's
#: Transformers backend runs)
LAYOUTS = ("", "(b p) ...", "b p s d", "s b p d", "b p (s d)", "s (b p) d", "1 (b p) ...", "b h p d")

#: the layout of a vLLM read inside a batch axis of one (see ``LAYOUTS``)
ONE = "1 (b p) ..."

#: the model-level site, computed from the final hidden states (not read from a layer)
LOGITS = "logits"

#: (layer, module path, phase): one hook, and the addresses read there
Group = tuple[int, str, str]


def layer_module(layer, path: str):
    """The module at ``path`` inside the decoder ``layer``: ``""`` is the layer itself, and of
    alternatives ``"a|b"`` the first that the layer has."""
    if not path:
        return layer
    for option in path.split("|"):
        try:
            return layer.get_submodule(option)
        except AttributeError:
            continue
    raise InternalError(f"[Internal] this {type(layer).__name__} has none of {path.split('|')}")


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


#: the residual contribution of each block -> the block's raw output it equals without a post-block norm
CONTRIBUTIONS = {"attn_out_post": "attn_out", "mlp_out_post": "mlp_out"}


def with_contributions(table: dict) -> dict:
    """``table`` (a site table, or refusal reasons by site) with ``attn_out_post`` / ``mlp_out_post``
    read (or refused) as the raw ``attn_out`` / ``mlp_out`` where the table does not name them: a
    family without post-block norms adds each block's raw output to the residual as it is. A family
    with post-block norms (Gemma 2 / 3 / 3n, OLMo 2 / 3) names both in its table."""
    extra = {post: table[raw] for post, raw in CONTRIBUTIONS.items() if raw in table and post not in table}
    return {**table, **extra} if extra else table


@dataclasses.dataclass(frozen=True)
class Arch:
    """Everything the engine knows about one model family, as data: the backends, the unembedding
    and the analysis helpers read these fields and hold no branch on the family.

    Module paths are relative to the model (``layers``, ``final_norm``, ``unembed``, ``embed``) or
    to a decoder layer (``attention``, ``o_proj``, ``vllm_attention``).
    """

    family: str
    model_types: tuple[str, ...]
    sites: dict[str, Hook]
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    unembed: str = "lm_head"
    #: the input embedding, which unembeds where the weights are tied and there is no ``unembed``
    embed: str = "model.embed_tokens"
    attention: str = "self_attn"
    o_proj: str = "self_attn.o_proj"
    #: how the projection weights inside a layer are stored in the Hugging Face model: ``"out_in"``
    #: (``nn.Linear``: ``[out, in]``) or ``"in_out"`` (GPT-2's ``Conv1D``: ``[in, out]``);
    #: :meth:`linear_weight` gives ``[out, in]``. The unembedding is an ``nn.Linear`` (or the
    #: embedding) in every family, and vLLM loads every projection as ``[out, in]``.
    weights: str = "out_in"
    #: config attribute holding the final logit softcapping ("" where the family has none)
    logit_softcap: str = ""
    #: config attribute holding the number of residual streams ("" for a single stream)
    streams_config: str = ""
    #: where the vLLM backend reads each site it serves (empty: not served on vLLM). vLLM's
    #: decoder layers fuse the residual add into the next norm, so most of its reads differ
    #: (see :mod:`interp_engine.archs.vllm_reads`)
    vllm: dict[str, Hook] = dataclasses.field(default_factory=dict)
    #: vLLM's attention kernel module inside a layer (it knows the heads and head size it runs)
    vllm_attention: str = "self_attn.attn"
    #: where ``model_type`` alone does not decide the family: a test on the whole config (None: none)
    matches: Callable[[Any], bool] | None = None
    #: why the family has no module for a site it leaves out of ``sites`` (shown when it is asked for)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    #: why the vLLM backend does not serve this family at all ("" where it does or nobody has looked):
    #: shown when such a model is loaded with ``backend="vllm"``, before any engine starts
    vllm_unsupported: str = ""
    #: why ``vllm`` leaves out a site that ``sites`` serves (shown when it is asked for on vLLM)
    vllm_refused: dict[str, str] = dataclasses.field(default_factory=dict)
    #: vLLM runs this family through its Transformers backend (the Hugging Face modules inside
    #: vLLM), which rewrites the Hugging Face decoder class in the process that runs it (its
    #: ``__init__`` and ``__call__``, for torch.compile): an eager model of the family in that
    #: process would break, so the vLLM backend gives such an engine's worker a process of its own
    vllm_transformers_backend: bool = False
    #: model-level paths (``layers``, ``final_norm``, ``embed``, ``unembed``) and the layer-level
    #: ``o_proj`` where vLLM's model differs from the Hugging Face one (vLLM's Transformers backend
    #: keeps the decoder as ``model``; vLLM's GPT-OSS names its attention block ``attn``)
    vllm_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    #: config attributes that hold the MLP width, the head size and the KV-head count, in the order
    #: they are tried (the first that is set wins); without one: ``d_mlp_ratio * d_model``,
    #: ``d_model // n_heads`` and ``n_heads``
    d_mlp_from: tuple[str, ...] = ("intermediate_size",)
    d_head_from: tuple[str, ...] = ("head_dim",)
    n_kv_heads_from: tuple[str, ...] = ("num_key_value_heads",)
    d_mlp_ratio: int = 0
    #: config attributes holding one head's query / key width where it differs from ``d_head``
    #: (multi-head latent attention: ``qk_head_dim``); empty where it is ``d_head``
    d_head_qk_from: tuple[str, ...] = ()
    #: config attribute listing each layer's kind (``"layer_types"``), where the kinds differ in
    #: which sites exist ("" where every layer is alike)
    layer_kinds: str = ""
    #: the layer kinds whose token mixer is softmax attention with heads, where ``z`` / ``q`` /
    #: ``k`` / ``v`` / ``pattern`` exist (empty: every layer's); a hybrid model's other layers
    #: (linear attention) have none
    attention_kinds: tuple[str, ...] = ()
    #: found and proven on a loaded model by the generic path (:mod:`.generic`), not written here
    generic: bool = False

    def __post_init__(self):
        if self.weights not in ("out_in", "in_out"):
            raise ValueError(f"Arch {self.family!r}: weights must be 'out_in' or 'in_out', got {self.weights!r}")
        for field in ("sites", "vllm", "refused", "vllm_refused"):
            object.__setattr__(self, field, with_contributions(getattr(self, field)))
        paths = {"embeddings": Hook(self.embed, "out"), "lm_head": Hook(self.unembed, "out"),
                 "ln_final_normalized": Hook(self.final_norm, "normalized")}
        object.__setattr__(self, "sites", {**{s: h for s, h in paths.items() if h.module and s not in self.refused},
                                              **self.sites})

    def fits(self, config) -> bool:
        """Whether a transformers ``config`` is a model of this family."""
        return getattr(config, "model_type", None) in self.model_types and (
            self.matches is None or bool(self.matches(config)))

    def softcap(self, config) -> float | None:
        """The final logit softcapping of a model of this family with ``config`` (None: none)."""
        return (getattr(config, self.logit_softcap, None) or None) if self.logit_softcap else None

    def vllm_path(self, name: str) -> str:
        """The path ``name`` (``"layers"``, ``"final_norm"``, ``"embed"``, ``"unembed"``, ``"o_proj"``)
        inside vLLM's model of this family."""
        return self.vllm_paths.get(name, getattr(self, name))

    def dims(self, config) -> dict[str, int]:
        """``d_mlp``, ``d_head`` and ``n_kv_heads`` of a model of this family, from the config
        names the family uses."""
        d_model, n_heads = config.hidden_size, config.num_attention_heads
        d_mlp = _first(config, self.d_mlp_from) or self.d_mlp_ratio * d_model
        return {"d_mlp": max(d_mlp) if isinstance(d_mlp, (list, tuple)) else d_mlp,
                "d_head": _first(config, self.d_head_from) or d_model // n_heads,
                "n_kv_heads": _first(config, self.n_kv_heads_from) or n_heads}

    def linear_weight(self, weight):
        """A projection's weight as ``nn.Linear`` holds it, ``[out_features, in_features]``,
        whichever way this family stores it."""
        return weight.t() if self.weights == "in_out" else weight


def _first(config, names: tuple[str, ...]):
    """The first of the config attributes ``names`` that is set (0 where none is)."""
    for name in names:
        value = getattr(config, name, None)
        if value:
            return value
    return 0
