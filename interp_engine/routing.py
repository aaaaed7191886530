"""Reading MoE routing out of a cache.

A token of an MoE layer is sent to ``top_k`` of the layer's ``n_experts`` experts, each with a
weight. The cache holds that selection sparsely (``expert_indices`` / ``expert_weights``,
``[batch, pos, top_k]``, captured on the eager backend) and the gate's scores densely
(``router_logits``, ``[batch, pos, n_experts]``, both backends). :func:`expert_assignment` turns
either into one dense ``[batch, pos, n_experts]`` tensor: each token's weight on every expert.
"""

from __future__ import annotations

import torch

from .address import Address
from .cache import Cache
from .errors import RoutingError, shown
from .scalars import integer


def expert_assignment(
    cache: Cache,
    layer: int,
    n_experts: int,
    *,
    top_k: int | None = None,
    renormalize: bool | None = None,
) -> torch.Tensor:
    """Each token's weight on every expert of ``layer``: ``[batch, pos, n_experts]``.

    Where the cache holds ``expert_weights.L`` and ``expert_indices.L`` (eager), this scatters
    the selection the model actually used: zero for experts not selected, and each row sums to
    whatever the family's rule gives (1 for softmax-top-k with renormalisation — Qwen3-MoE,
    Mixtral; at most 1 without it — OLMoE; ``routed_scaling_factor`` for DeepSeek-V4).

    Where the cache holds only ``router_logits.L`` (the vLLM backend serves no selection), it
    applies the softmax-top-k rule of Qwen3-MoE, OLMoE and Mixtral, which you must name:
    ``top_k`` experts by softmax probability, renormalised to sum to 1 when ``renormalize``
    (the config's ``norm_topk_prob``; always True for Mixtral). This is a re-derivation: where
    router scores tie it may pick a different expert than the engine did, and it does not
    reproduce other rules (DeepSeek's sigmoid/bias/hash routing) — capture ``expert_*`` on the
    eager backend for those.

    >>> dense = expert_assignment(cache, 10, n_experts=128)              # doctest: +SKIP
    >>> dense = expert_assignment(vllm_cache, 10, 128, top_k=8, renormalize=True)  # doctest: +SKIP
    """
    names = ("expert_weights", "expert_indices", "router_logits")
    weights_at, indices_at, logits_at = (Address(n, layer) for n in names)
    if integer(n_experts) is None or integer(n_experts) <= 0:
        raise RoutingError(f"n_experts must be a positive int (the model's expert count), got {shown(n_experts)}")
    n_experts = integer(n_experts)
    if weights_at in cache and indices_at in cache:
        indices, weights = cache[indices_at], cache[weights_at]
        if logits_at in cache:
            _check_width(cache[logits_at].shape[-1], n_experts, layer)
        if indices.numel() and int(indices.max()) >= n_experts:
            raise RoutingError(
                f"expert_indices.{layer} holds expert {int(indices.max())} but n_experts={n_experts}: "
                f"pass the model's expert count (model.info.n_experts)"
            )
        if top_k is not None and top_k != indices.shape[-1]:
            raise RoutingError(
                f"top_k={top_k} but the cache's selection holds {indices.shape[-1]} experts per token; "
                f"leave top_k out when the cache holds expert_indices.{layer}"
            )
        dense = torch.zeros(*indices.shape[:-1], n_experts, dtype=weights.dtype, device=weights.device)
        # Padded positions hold index 0 and weight 0, so they scatter nothing.
        return dense.scatter_add(-1, indices.long(), weights)
    if logits_at in cache:
        logits = cache[logits_at]
        _check_width(logits.shape[-1], n_experts, layer)
        if top_k is None or renormalize is None:
            raise RoutingError(
                f"the cache holds router_logits.{layer} but no selection (expert_weights / expert_indices.{layer}), "
                f"so the routing rule must be named: expert_assignment(cache, {layer}, {n_experts}, "
                f"top_k=<num_experts_per_tok>, renormalize=<norm_topk_prob>); or capture the selection on the "
                f"eager backend"
            )
        if not 0 < top_k <= n_experts:
            raise RoutingError(f"top_k must be in 1..{n_experts}, got {top_k}")
        probs = torch.softmax(logits.float(), dim=-1)
        values, indices = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            values = values / values.sum(dim=-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter(-1, indices, values)
        return torch.where(cache.mask[..., None].to(dense.device), dense, torch.zeros((), dtype=dense.dtype))
    held = ", ".join(str(a) for a in cache) or "nothing"
    raise RoutingError(
        f"the cache holds no routing for layer {layer} (it holds: {held}); capture "
        f"['expert_weights.{layer}', 'expert_indices.{layer}'] (eager) or 'router_logits.{layer}' (any backend)"
    )


def _check_width(width: int, n_experts: int, layer: int) -> None:
    if width != n_experts:
        raise RoutingError(
            f"n_experts={n_experts} does not match the model: router_logits.{layer} scores {width} experts. "
            f"Pass n_experts={width} (model.info.n_experts)"
        )
