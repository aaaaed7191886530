"""Analysis helpers: functions of a cache (and the model's weights), not points of capture.

The cache stays data; these read it. ``stack`` puts one site's layers together,
``accumulated_resid`` is the residual stream layer by layer (``resid_pre.L`` at entry ``L``),
``decompose_resid`` splits it into what wrote it (embedding, every ``attn_out_post`` and ``mlp_out_post``,
summing back to it), and ``logit_attribution`` says how much each piece adds to a token's logit.
"""

from __future__ import annotations

import torch

from .address import Address
from .analysis_checks import broadcastable, check_layer, check_width, layer_count, layer_list, require_held, token_ids
from .errors import AnalysisError, InternalError, MissingActivations, shown
from .cache import Cache
from .frozen_norm import freeze
from .protocol import HasOProj, HasUnembedding, require


def head_contributions(model, cache: Cache, layer: int) -> torch.Tensor:
    """What each attention head writes into the residual at ``layer``: ``[batch, pos, n_heads, d_model]``.

    ``z.layer`` through each head's slice of the output projection. Summed over heads (plus the
    projection's bias, if any) it is the output projection's output. This is ``n_heads`` times
    the size of ``z``, so it is computed on demand rather than captured.
    """
    require(model, HasOProj, "head_contributions", "each layer's attention output projection (model.o_proj_weight)",
            ("o_proj_weight",))
    n = model.n_layers
    layer = check_layer("head_contributions", layer, n - 1, f"the last of {n} layers")
    require_held("head_contributions", cache, [Address("z", layer)],
                 f"capture it: run_with_cache(model, tokens, ['z.{layer}'])")
    z = cache.get("z", layer)  # [b, p, h, d_head]
    if tuple(z.shape[-2:]) != (model.n_heads, model.d_head):
        raise AnalysisError(f"head_contributions: z.{layer} in this cache is {tuple(z.shape[-2:])} (heads, d_head), "
                            f"but {model.name} has ({model.n_heads}, {model.d_head}): it comes from another model")
    weight = model.o_proj_weight(layer)  # [d_model, h * d_head], as nn.Linear holds it (Arch.linear_weight)
    if tuple(weight.shape) != (model.d_model, model.n_heads * model.d_head):
        raise InternalError(
            f"[Internal] o_proj_weight({layer}) is {tuple(weight.shape)}, not [d_model, n_heads * d_head] = "
            f"{[model.d_model, model.n_heads * model.d_head]}: the family record's weights= ('out_in' / 'in_out') "
            f"does not say how this model stores it")
    w = weight.reshape(weight.shape[0], model.n_heads, model.d_head).to(z.dtype)
    return torch.einsum("bphd,mhd->bphm", z, w.to(z.device))


def _layers_held(cache: Cache, site: str) -> list[int]:
    return sorted(a.layer for a in cache if a.name == site and a.layer is not None)


def stack(cache: Cache, site: str, layers=None) -> torch.Tensor:
    """One site at several layers as one tensor, ``[layers, batch, pos, ...]``.

    ``layers`` defaults to every layer of ``site`` the cache holds, in layer order; an int is one
    layer (kept as a layer axis of 1) and a negative layer counts from the model's last;
    ``stack(cache, "resid_post")[i]`` is ``cache[f"resid_post.{layers[i]}"]``.
    """
    from .address import SITES

    if site not in SITES or not SITES[site].per_layer:
        per_layer = [n for n, s in SITES.items() if s.per_layer]
        hint = f" (the layer goes in layers=: stack(cache, {site.split('.')[0]!r}, layers=[...]))" if "." in str(site) else ""
        raise AnalysisError(f"stack: site must be the name of a per-layer site such as 'resid_post', got "
                            f"{shown(site)}{hint}; per-layer sites: {', '.join(per_layer)}")
    held = _layers_held(cache, site)
    if layers is not None:
        n = cache.n_layers or (held[-1] + 1 if held else 1)
        known = "" if cache.n_layers else f"this cache reaches layer {n - 1} (it does not know its model's layer count)"
        layers, _ = layer_list(f"stack({site!r})", layers, n - 1, f"the last of {n} layers", known)
    else:
        layers = held
    missing = [L for L in layers if L not in held]
    if not layers or missing:
        raise MissingActivations(f"stack({site!r}) needs {site} at layers {missing or 'any'}; this cache holds {site} at "
                       f"{held or 'no layer'}. Capture the whole site: run_with_cache(model, tokens, [{site!r}])")
    return torch.stack([cache.get(site, L) for L in layers])


def _resid_pre_address(cache: Cache, layer: int) -> Address | None:
    """Where the cache holds the stream entering ``layer``: ``resid_pre.L``, or ``resid_post.(L-1)``,
    which is the same tensor (None where it holds neither)."""
    if Address("resid_pre", layer) in cache:
        return Address("resid_pre", layer)
    if layer > 0 and Address("resid_post", layer - 1) in cache:
        return Address("resid_post", layer - 1)
    return None


def _resid_pre(cache: Cache, layer: int) -> torch.Tensor:
    """``resid_pre.L``, or ``resid_post.(L-1)``, which is the same tensor."""
    address = _resid_pre_address(cache, layer)
    if address is not None:
        return cache[address]
    need = "'resid_pre.0' (the embedding)" if layer == 0 else f"'resid_pre.{layer}' or 'resid_post.{layer - 1}'"
    raise MissingActivations(f"the residual stream entering layer {layer} is not in this cache: capture {need}, "
                             f"e.g. run_with_cache(model, tokens, ['resid_pre.0', 'resid_post'])")


def accumulated_resid(cache: Cache, layer: int | None = None, *, apply_ln: bool = False, model=None,
                      return_labels: bool = False):
    """The residual stream as it accumulates: ``[layer + 1, batch, pos, d_model]``.

    Entry ``L`` is the stream entering layer ``L`` (``resid_pre.L``, read as ``resid_post.(L-1)``
    where that is what the cache holds). ``layer=None`` goes to the end: entries
    ``0 .. n_layers - 1`` and then the final ``resid_post`` (``n_layers + 1`` entries).
    ``apply_ln=True`` puts each entry through the model's final norm (needs ``model``): each entry
    is a whole residual stream, so this is the logit lens's input at every depth.
    """
    if apply_ln and model is None:
        raise AnalysisError("apply_ln=True needs the model's final norm: accumulated_resid(cache, ..., model=model)")
    n, known = layer_count(cache, model)
    last = n if layer is None else check_layer("accumulated_resid", layer, n, "the final resid_post", known)
    entries = range(min(last + 1, n))
    missing = [L for L in entries if _resid_pre_address(cache, L) is None]
    require_held("accumulated_resid", cache,
                 [Address("resid_pre", L) for L in missing] + ([Address("resid_post", n - 1)] if last == n else []),
                 "capture 'resid_pre.0' (the embedding) and 'resid_post' (resid_post.L stands for "
                 "resid_pre.(L+1)): run_with_cache(model, tokens, ['resid_pre.0', 'resid_post'])")
    rows = [_resid_pre(cache, L) for L in entries]
    labels = [f"resid_pre.{L}" for L in range(len(rows))]
    if last == n:
        rows.append(cache.get("resid_post", n - 1))
        labels.append(f"resid_post.{n - 1}")
    out = torch.stack(rows)
    if apply_ln:
        check_width("accumulated_resid", out, model, "the residual stream in this cache")
        with torch.no_grad():
            out = model.final_norm(out)
    return (out, labels) if return_labels else out


def decompose_resid(cache: Cache, layer: int | None = None, *, model=None, return_labels: bool = False):
    """The residual stream entering ``layer`` (default: the final ``resid_post``) as the sum of what
    wrote it: the embedding (``resid_pre.0``), then ``attn_out_post.L`` and ``mlp_out_post.L`` (what
    each block adds to the residual, after any post-block norm) of every earlier layer,
    ``[components, batch, pos, d_model]``. Summed over components it is that residual stream.

    ``layer`` runs over ``0..n_layers`` (``n_layers``: the final ``resid_post``). ``n_layers`` is
    the model's where ``model=`` is given, else read from the deepest layer the cache holds
    anything at. A cache that lacks a component is refused, naming what it lacks."""
    n, known = layer_count(cache, model)
    upto = n if layer is None else check_layer("decompose_resid", layer, n, "the final resid_post", known)
    needed = [Address("resid_pre", 0)] + [Address(site, L) for L in range(upto)
                                           for site in ("attn_out_post", "mlp_out_post")]
    require_held(f"decompose_resid (layer={upto})", cache, needed,
                 "capture them: run_with_cache(model, tokens, ['resid_pre.0', 'attn_out_post', 'mlp_out_post'])")
    rows, labels = [cache[needed[0]]], ["embed"]
    for address in needed[1:]:
        rows.append(cache[address])
        labels.append(str(address))
    out = torch.stack(rows)
    return (out, labels) if return_labels else out


def final_scale(model, resid: torch.Tensor) -> torch.Tensor:
    """The final norm as a linear map *at* ``resid``: ``scale`` of shape ``[..., d_model]`` with
    ``final_norm(resid) == resid * scale`` for an RMS norm, and ``(resid - mean) * scale + bias``
    for a LayerNorm (GPT-2, GPT-NeoX; ``bias`` is ``final_norm(0)``).

    A norm divides by one number per position (after centring, for a LayerNorm) and multiplies by
    a gain per feature. Frozen at the final residual, that is affine, so the components of a
    decomposition can each be put through its linear part and still sum to ``final_norm(resid)``
    less the bias (the usual way of attributing logits to components; :mod:`.frozen_norm`)."""
    check_width("final_scale", resid, model, "the residual stream")
    return freeze(model.final_norm, resid).scale


def _directions(model, target) -> torch.Tensor:
    """Unembedding directions ``[..., d_model]`` for token ids (an int, a list or a tensor of
    ids), a single-token string, or directions given as a float tensor."""
    call = "logit_attribution"
    if isinstance(target, str):
        ids = model.tok.encode(target, prepend_bos=False)
        if len(ids) != 1:
            raise AnalysisError(f"{call}: {target!r} is {len(ids)} tokens {model.to_str_tokens(ids)}; "
                                f"pass one token or its id")
        target = ids[0]
    weight = model.unembed_weight().detach()
    ids = token_ids(call, target, weight.shape[0])
    if ids.is_floating_point():
        check_width(call, ids, model, "the direction given")
        return ids
    return weight[ids.to(weight.device)]


def logit_attribution(model, cache: Cache, tokens_or_directions, components: torch.Tensor | None = None):
    """How much each component adds to the logit of a token, ``[components, batch, pos]``.

    ``components`` (default: :func:`decompose_resid` of the cache) are put through the final norm
    frozen at the final residual (:func:`final_scale`) and dotted with each token's unembedding
    direction. ``tokens_or_directions``: a token id, a one-token string, ids ``[batch, pos]`` (one
    per position, e.g. the next tokens) or directions ``[d_model]`` / ``[batch, pos, d_model]``.
    Summed over the default components it is the token's logit before any final softcapping,
    less the final norm's bias term ``final_norm(0) . direction`` where the norm has a bias
    (LayerNorm: GPT-2, GPT-NeoX); the unembedding has no bias in the supported families. ``head_contributions(...)`` moved to
    the front (``.permute(2, 0, 1, 3)``) gives per-head attributions.
    """
    require(model, HasUnembedding, "logit_attribution",
            "the model's final norm and unembedding (model.final_norm and model.unembed_weight)",
            ("final_norm", "unembed_weight"))
    call = "logit_attribution"
    n = model.n_layers
    require_held(call, cache, [Address("resid_post", n - 1)],
                 f"it reads the final residual stream resid_post.{n - 1}: capture it with the components")
    final = cache.get("resid_post", n - 1)
    check_width(call, final, model, f"resid_post.{n - 1} in this cache")
    if components is None:
        components = decompose_resid(cache, model=model)
    elif not isinstance(components, torch.Tensor) or components.dim() < 2:
        raise AnalysisError(f"{call}: components must be a tensor [components, ..., d_model] (e.g. "
                            f"decompose_resid(cache, model=model)), got {type(components).__name__}")
    check_width(call, components, model, "components")
    broadcastable(call, "components", components.shape[1:], final.shape, "components captured with this cache")
    frozen = freeze(model.final_norm, final)
    direction = _directions(model, tokens_or_directions).to(frozen.scale.device, frozen.scale.dtype)
    broadcastable(call, "tokens_or_directions (read as directions)", direction.shape, final.shape,
                  "an id, ids [batch, pos] or a direction [d_model] / [batch, pos, d_model]")
    return (frozen.linear(components) * direction).sum(-1)
