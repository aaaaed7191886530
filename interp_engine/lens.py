"""The logit lens: reading the residual stream of every layer as if it were the last.

The model turns its final residual stream into logits with two steps: a final norm and the
unembedding (plus logit softcapping in Gemma 2). Applying those same two steps to
``resid_post.L`` of an earlier layer L gives the logits the model "would" output if it stopped
after layer L. Watching the top token change from layer to layer shows where in depth a
prediction forms. At the last layer the lens is exact: it equals the model's own logits.

The lens is a function of a :class:`Cache` and the model's weights (through the model's
``final_norm`` and ``unembed``, on every backend: a vLLM or cluster model fetches them once from
its workers or a replica), not a capture point: capture ``resid_post`` at the layers you want,
then call :func:`logit_lens`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .address import Address
from .analysis_checks import check_width, layer_list
from .errors import MissingActivations
from .cache import Cache
from .protocol import HasUnembedding, require


class LensTop(NamedTuple):
    """The lens's top token at every (layer, batch, pos): ids, probabilities and the layers read."""

    ids: torch.Tensor  # [layers, batch, pos]
    probs: torch.Tensor  # [layers, batch, pos]
    layers: list[int]


def _lens_layers(model, cache: Cache, layers) -> list[int]:
    """The layers to read: every ``resid_post`` the cache holds (None), one int or a list; a
    negative layer counts from the model's last layer (``-1``)."""
    held = sorted(a.layer for a in cache if a.name == "resid_post")
    if layers is None:
        if not held:
            raise MissingActivations(
                "logit_lens reads resid_post.L, and this cache holds none. Capture them first: "
                "run_with_cache(model, tokens, [Address('resid_post', L) for L in range(model.n_layers)])"
            )
        return held
    n = getattr(model, "n_layers", None) or (held[-1] + 1 if held else 1)
    layers, _ = layer_list("logit_lens", layers, n - 1, f"the last of {n} layers")
    missing = [L for L in layers if L not in held]
    if missing:
        raise MissingActivations(
            f"logit_lens needs resid_post at layers {missing}, which this cache does not hold "
            f"(it holds resid_post at {held or 'no layer'}); add them to the points you capture"
        )
    return layers


def _check_model(model) -> None:
    require(model, HasUnembedding, "logit_lens",
            "the model's final norm and unembedding (model.final_norm and model.unembed)", ("final_norm", "unembed"))


def logit_lens(model, cache: Cache, layers=None) -> torch.Tensor:
    """Logits read from ``resid_post`` of each layer: ``[len(layers), batch, pos, vocab]``.

    ``layers`` defaults to every layer whose ``resid_post`` the cache holds, in order; an int is
    one layer (``layers=20`` is ``layers=[20]``), and a negative layer counts from the last
    (``-1``). Padded
    positions hold zeros. The last layer's row equals the model's logits.
    """
    _check_model(model)
    rows = []
    for layer in _lens_layers(model, cache, layers):
        resid = cache[Address("resid_post", layer)]
        check_width("logit_lens", resid, model, f"resid_post.{layer} in this cache")
        logits = model.unembed(model.final_norm(resid))
        real = cache.mask[..., None].to(logits.device)
        rows.append(logits.masked_fill(~real, 0.0))
    return torch.stack(rows)


@torch.no_grad()
def lens_top(model, cache: Cache, layers=None) -> LensTop:
    """The lens's top token and its probability at every layer and position.

    Layer by layer, so memory stays at one ``[batch, pos, vocab]`` block, however many layers.
    """
    _check_model(model)
    layers = _lens_layers(model, cache, layers)
    ids, probs = [], []
    for layer in layers:
        logits = logit_lens(model, cache, [layer])[0].float()
        p, i = logits.softmax(-1).max(-1)
        ids.append(i.cpu())
        probs.append(p.cpu())
    return LensTop(torch.stack(ids), torch.stack(probs), layers)
