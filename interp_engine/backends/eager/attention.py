"""Reading q, k, v and the attention pattern from Hugging Face attention layers.

transformers computes attention through a named function from its ``AttentionInterface``
registry, after rotary embeddings and any qk-norm. We register two names that wrap the
standard ones — ``interp_sdpa`` (around ``sdpa``) and ``interp_eager`` (around the family's own
eager function, which forms the probabilities, with softcapping where the family has it) — and
tell any listener attached to an attention module what went in and came out. An *editor*
attached to a module may replace q, k and v before attention and the probabilities after
(the output is then recomputed from the edited probabilities). With neither the wrappers only
forward the call.

A model runs ``interp_sdpa`` by default; a call that asks for ``pattern`` switches it to
``interp_eager`` for that call only, since SDPA never forms the probabilities.

Some families' modeling code branches on the implementation's literal name (HY-V4, DeepSeek-V3.2,
GLM-MoE-DSA, GLM-5-Next, AXK2: the top-k index mask, attention sinks and the mask's form apply
only under ``"eager"`` / ``"sdpa"``), so under a renamed one they compute another model. Those
(:data:`NAME_BRANCHING`) always run under ``"eager"`` itself, their modeling module's eager
function wrapped the way ``interp_eager`` wraps it (forwarding untouched when nothing listens).

Written against transformers 5.19 (``AttentionInterface``, ``AttentionMaskInterface``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable

import torch

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

SDPA = "interp_sdpa"
EAGER = "interp_eager"

#: transformers' model packages whose modeling code branches on the implementation's literal name
NAME_BRANCHING = frozenset({"hy_v4", "deepseek_v32", "glm_moe_dsa", "glm5_next", "axk2"})

# attention module -> callback(query, key, value, weights); weak so a dropped model frees itself
_LISTENERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# attention module -> editor with .inputs(q, k, v) -> (q, k, v) and .weights(w) -> w or None
_EDITORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _family_eager(module) -> Callable:
    """The family's own eager attention function (it knows its softcapping and scaling)."""
    family = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return getattr(family, "__wrapped__", family)  # the original under a NAME_BRANCHING wrapper


def _notify(module, query, key, value, weights, scores=None):
    listener = _LISTENERS.get(module)
    if listener is not None:
        listener(query, key, value, weights, scores)


def _scores(module, query, key, attention_mask, kwargs):
    """The pre-softmax scores as the standard eager attention forms them (the families whose
    record serves ``attn_scores``): ``q k^T * scaling``, then the logit softcap the module passes,
    then the additive mask (masked entries are the dtype's minimum). Sinks are not scores."""
    groups = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    scaling = kwargs.get("scaling")
    scores = torch.matmul(query, keys.transpose(2, 3)) * (module.head_dim**-0.5 if scaling is None else scaling)
    cap = kwargs.get("softcap")
    if cap:
        scores = torch.tanh(scores / cap) * cap
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        scores = scores + attention_mask[..., : keys.shape[-2]]
    return scores


def _interp_sdpa(module, query, key, value, attention_mask, **kwargs):
    editor = _EDITORS.get(module)
    if editor is not None:
        query, key, value = editor.inputs(query, key, value)
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    _notify(module, query, key, value, weights)
    return out, weights


def _interp_eager(module, query, key, value, attention_mask, **kwargs):
    editor = _EDITORS.get(module)
    if editor is not None:
        query, key, value = editor.inputs(query, key, value)
    out, weights = _family_eager(module)(module, query, key, value, attention_mask, **kwargs)
    scores = lambda: _scores(module, query, key, attention_mask, kwargs)  # noqa: E731  (formed only if asked)
    if editor is not None:
        edited = editor.weights(weights)
        if edited is not None:  # the output is the edited probabilities times the values
            weights = edited
            groups = query.shape[1] // value.shape[1]
            values = value.repeat_interleave(groups, dim=1) if groups > 1 else value
            out = torch.matmul(weights.to(values.dtype), values).transpose(1, 2).contiguous()
    _notify(module, query, key, value, weights, scores)
    return out, weights


def _register() -> None:
    if SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(SDPA, _interp_sdpa)
        ALL_ATTENTION_FUNCTIONS.register(EAGER, _interp_eager)
        ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA, sdpa_mask)
        ALL_MASK_ATTENTION_FUNCTIONS.register(EAGER, eager_mask)


def _name_branching_modules(hf_model) -> set:
    """The model's modeling modules that belong to a :data:`NAME_BRANCHING` package."""
    names = {type(module).__module__ for module in hf_model.modules()}
    return {sys.modules[n] for n in names
            if n.startswith("transformers.models.") and n.split(".")[2] in NAME_BRANCHING}


def _wrap_eager(modeling) -> None:
    """Route ``modeling``'s eager attention function through ``_interp_eager`` (once)."""
    original = getattr(modeling, "eager_attention_forward", None)
    if original is None or hasattr(original, "__wrapped__"):
        return

    def eager_attention_forward(module, query, key, value, attention_mask, **kwargs):
        return _interp_eager(module, query, key, value, attention_mask, **kwargs)

    eager_attention_forward.__wrapped__ = original
    modeling.eager_attention_forward = eager_attention_forward


def set_implementation(hf_model, name: str) -> None:
    """Point every config in the model at the attention implementation ``name`` (at ``"eager"``
    itself, wrapped, for the :data:`NAME_BRANCHING` families)."""
    _register()
    branching = _name_branching_modules(hf_model)
    if branching and name in (SDPA, EAGER):
        for modeling in branching:
            _wrap_eager(modeling)
        name = "eager"
    for module in hf_model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def implementation(hf_model) -> str:
    return hf_model.config._attn_implementation


@contextlib.contextmanager
def using(hf_model, name: str):
    """Run with attention implementation ``name``, restoring the previous one afterwards."""
    previous = implementation(hf_model)
    if previous == name:
        yield
        return
    set_implementation(hf_model, name)
    try:
        yield
    finally:
        set_implementation(hf_model, previous)


@contextlib.contextmanager
def editing(module, editor):
    """Let ``editor`` replace what ``module`` attends with (see the module docstring)."""
    _EDITORS[module] = editor
    try:
        yield
    finally:
        _EDITORS.pop(module, None)


@contextlib.contextmanager
def listening(module, callback):
    """Call ``callback(query, key, value, weights, scores)`` each time ``module`` attends (``scores``:
    a function that forms the pre-softmax scores, on the eager path; None on SDPA)."""
    _LISTENERS[module] = callback
    try:
        yield
    finally:
        _LISTENERS.pop(module, None)
