"""The checks the analysis helpers make on what they are given, and the errors they raise.

An analysis helper reads a cache and the model's weights. Given a cache that lacks a tensor it
needs, a layer out of range, a token id outside the vocabulary or a tensor of another model's
width, torch would either fail deep inside with a size-mismatch or an index error, or — worse —
compute something else without a word (``-1`` reads the last vocabulary row; ``True`` is layer 1;
a cache without ``attn_out_post`` decomposes into the embedding alone). So every argument is checked
here first, and the error says what is missing or wrong and how to fix it.

A negative layer counts from the end of the helper's range, as Python indexing does: ``-1`` is
the last layer for the lens, ``stack`` and ``head_contributions`` (``0..n_layers - 1``) and the
final ``resid_post`` for ``accumulated_resid`` / ``decompose_resid`` (``0..n_layers``). Negative
token ids are refused (they would read the vocabulary from its end without a word).
"""

from __future__ import annotations


import torch

from .address import format_address
from .cache import Cache
from .errors import AnalysisError, MissingActivations, shown
from .scalars import integer


def layer_count(cache: Cache, model=None) -> tuple[int, str]:
    """The model's number of layers and where it was read: from ``model``, else from the cache
    (the capture call recorded it), else from the deepest layer this cache holds anything at."""
    if model is not None:
        return model.n_layers, f"{getattr(model, 'name', 'the model')} has {model.n_layers} layers"
    if getattr(cache, "n_layers", None):
        return cache.n_layers, f"this cache's model has {cache.n_layers} layers"
    layered = [a.layer for a in cache if a.layer is not None]
    if not layered:
        raise MissingActivations(
            "this cache holds no per-layer activation, so the number of layers is unknown: capture the "
            "points the helper needs, or pass model= so it reads the model's n_layers")
    n = max(layered) + 1
    return n, (f"this cache reaches layer {n - 1}, so it is read as a {n}-layer model; pass model= "
               f"to use the model's own layer count")


def check_layer(call: str, layer, n: int, meaning: str, known: str = "") -> int:
    """``layer`` as an int in ``0..n`` (``meaning`` says what ``n`` is; a negative layer counts
    from ``n``: ``-1`` is ``n``), or an error naming the range."""
    valid = f"0..{n} ({n} = {meaning}; -1 = {n}, -{n + 1} = 0)"
    if integer(layer) is None:
        raise AnalysisError(f"{call}: layer must be an int in {valid}, got {shown(layer)} ({type(layer).__name__})")
    layer = integer(layer)
    if not -(n + 1) <= layer <= n:
        raise AnalysisError(f"{call}: layer={layer} is out of range: layers are {valid}"
                            f"{'; ' + known if known else ''}")
    return int(layer) + (n + 1 if layer < 0 else 0)


def layer_list(call: str, layers, n: int, meaning: str, known: str = "") -> tuple[list[int], bool]:
    """``layers`` (an int, or a list / range / tensor of ints) as real layers in ``0..n`` (see
    :func:`check_layer`), and whether one int was given. A string is refused: it is an address
    or a site, not layer numbers (iterated, ``"resid_post.20"`` would read as its characters)."""
    if isinstance(layers, (str, bytes)):
        raise AnalysisError(f"{call}: layers takes layer numbers, got the string {layers!r:.60}; pass an int "
                            f"(layers=-1), a list (layers=[0, 5, -1]) or None for every layer held "
                            f"(cache[{layers!r:.40}] is the tensor of one address)")
    if integer(layers) is not None:
        return [check_layer(call, layers, n, meaning, known)], True
    if isinstance(layers, bool) or not hasattr(layers, "__iter__"):
        raise AnalysisError(f"{call}: layers must be an int or a list of ints (e.g. layers=[0, -1]), or None "
                            f"for every layer held, got {shown(layers)}")
    layers = [x.item() if isinstance(x, torch.Tensor) else x for x in layers]
    if not layers:
        raise AnalysisError(f"{call}: layers=[] names no layer; pass None for every layer the cache holds, an "
                            f"int or a non-empty list")
    return [check_layer(call, L, n, meaning, known) for L in layers], False


def require_held(call: str, cache: Cache, needed: list, fix: str) -> None:
    """Refuse if the cache lacks any of ``needed`` (addresses), naming every one it lacks."""
    missing = [a for a in needed if a not in cache]
    if not missing:
        return
    names = [format_address(a) for a in missing]
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    held = ", ".join(format_address(a) for a in cache) or "nothing"
    raise MissingActivations(f"{call} needs {listed}, which this cache does not hold (it holds {held}); {fix}")


def check_width(call: str, tensor: torch.Tensor, model, what: str) -> None:
    """Refuse ``tensor`` (``[..., d_model]``) if its width is not the model's ``d_model``."""
    d_model = getattr(model, "d_model", None)
    if d_model is None or tensor.shape[-1] == d_model:
        return
    raise AnalysisError(
        f"{call}: {what} is {tensor.shape[-1]} wide, but {getattr(model, 'name', 'the model')} has "
        f"d_model={d_model}: it comes from another model. Pass the model that captured the cache "
        f"(and a cache captured from this model)")


def token_ids(call: str, target, vocab: int) -> torch.Tensor:
    """Token ids (an int, a list or an integer tensor) as a long tensor, each in ``0..vocab-1``."""
    if isinstance(target, bool) or (isinstance(target, torch.Tensor) and target.dtype == torch.bool):
        raise AnalysisError(f"{call}: {target!r} is a bool, not a token id; pass an int id, ids, a "
                            f"one-token string or a float direction")
    try:
        ids = torch.as_tensor(target)
    except (TypeError, ValueError, RuntimeError) as err:
        raise AnalysisError(f"{call}: cannot read {target!r:.60} as token ids or directions ({err}); pass an "
                            f"int id, a list or tensor of ids, a one-token string or a float tensor") from None
    if ids.dtype == torch.bool or ids.is_complex() or not (ids.is_floating_point() or _integer(ids)):
        raise AnalysisError(f"{call}: token ids must be ints and directions real floats, got dtype {ids.dtype}")
    if ids.is_floating_point():
        return ids
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            raise AnalysisError(f"{call}: token id {low} is negative, and negative ids are not accepted here "
                                f"(they would read the vocabulary from its end); ids are 0..{vocab - 1}")
        if high >= vocab:
            raise AnalysisError(f"{call}: token id {high} is outside the vocabulary of {vocab} tokens "
                                f"(ids 0..{vocab - 1})")
    return ids.long()


def _integer(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def broadcastable(call: str, what: str, shape, to, expected: str) -> None:
    """Refuse ``shape`` if it does not broadcast against ``to``."""
    try:
        torch.broadcast_shapes(tuple(shape), tuple(to))
    except RuntimeError:
        raise AnalysisError(f"{call}: {what} has shape {tuple(shape)}, which does not fit the cache's "
                            f"{tuple(to)}; pass {expected}") from None
