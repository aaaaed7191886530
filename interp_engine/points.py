"""Points: which addresses a given model serves, and the user's point lists made into addresses.

An :class:`~interp_engine.address.Address` names a point on any model; whether *this* model
serves it depends on the model's facts (:class:`ModelInfo`: layers, streams, dense or MoE, its
family table) and on what its backend can read (:class:`~interp_engine.capabilities.Capabilities`).
:func:`check_points` turns what a user passes — addresses, strings, tuples, whole sites, filters —
into checked addresses, once, at the boundary; everything after it holds real layer numbers.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable

from .address import Address, FeatureAddress, format_address, parse_address, to_address
from .capabilities import Capabilities
from .errors import AddressError, shown
from .scalars import integer
from .vocab import our_name, unknown_site
from .sites import SITES, Site


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The facts about a model that decide which addresses it serves and their shapes."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    n_streams: int = 1
    n_experts: int = 0
    top_k: int = 0
    moe_layers: tuple[int, ...] = ()
    family: str = ""
    #: the site names this model's family table serves (empty: every site)
    sites: frozenset[str] = frozenset()
    #: the width of one head's query and key where it differs from ``d_head`` (the value's and
    #: ``z``'s width): multi-head latent attention (DeepSeek-V3). 0: the same
    d_head_qk: int = 0
    #: each layer's kind where the family's layers differ (a hybrid model's ``layer_types``)
    layer_kinds: tuple[str, ...] = ()
    #: the layers whose token mixer is softmax attention, where the per-head sites exist (empty: every layer)
    attention_layers: tuple[int, ...] = ()
    #: ``(site, why)`` for sites the family has no module for, where its record says why
    refused: tuple[tuple[str, str], ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


def valid_sites(info: ModelInfo, caps: Capabilities) -> list[str]:
    """The site names this model serves on the backend whose capabilities are ``caps``."""
    names = []
    for site in SITES.values():
        if site.moe and not info.is_moe:
            continue
        if info.sites and site.name not in info.sites:
            continue
        if site.needs_pattern and not caps.forms_pattern:
            continue
        if site.name not in caps.unserved:
            names.append(site.name)
    return names


def check_address(address: Address, info: ModelInfo, caps: Capabilities) -> None:
    """Raise an :class:`AddressError` that lists the valid options unless this model serves
    ``address`` on the backend whose capabilities are ``caps`` (``caps.unserved``: the sites it
    cannot read exactly). A feature point is checked at its site (whether a dictionary serves it
    is the call's to say: ``saes=``)."""
    if isinstance(address, FeatureAddress):
        return check_address(address.site, info, caps)
    site = SITES[address.name]
    backend = caps.name
    if site.moe and not info.is_moe:
        raise AddressError(
            f"{format_address(address)!r}: {info.name} is a dense model and has no MoE router; "
            f"valid sites: {', '.join(valid_sites(info, caps))}"
        )
    if site.single_stream and info.n_streams > 1:
        raise AddressError(
            f"{format_address(address)!r}: {info.name}'s residual is {info.n_streams} streams, so there is no "
            f"single {address.name!r}; capture the streams, e.g. "
            f"{[format_address(Address('resid_streams', address.layer, s)) for s in range(info.n_streams)]}, "
            f"or attn_out_post / mlp_out_post for what each block writes (see docs/MOE.md)"
        )
    if info.sites and address.name not in info.sites:
        why = dict(info.refused).get(address.name, site.absent or "its module is laid out differently there")
        raise AddressError(
            f"{format_address(address)!r}: the {info.family or info.name} family table has no {address.name!r} "
            f"({why}); valid sites: {', '.join(valid_sites(info, caps))}"
        )
    if site.needs_pattern and not caps.forms_pattern:
        raise AddressError(
            f"{format_address(address)!r} is eager-only: the {backend} backend never forms it. "
            f"Load the model with backend='eager' to capture it."
        )
    if address.name in caps.unserved and site.fallback:
        raise AddressError(
            f"{format_address(address)!r} is not served on the {backend} backend for {info.name}: "
            + site.fallback.format(L=address.layer)
        )
    if address.name in caps.unserved:
        why = dict(caps.reasons).get(address.name)
        raise AddressError(
            f"{format_address(address)!r} is not served on the {backend} backend"
            + (f" for {info.name}: {why}" if why else "")
            + f"; valid sites there: {', '.join(valid_sites(info, caps))}"
        )
    if site.per_layer:
        layers = info.moe_layers if site.moe and info.moe_layers else range(info.n_layers)
        if address.layer not in layers:
            valid = f"0..{info.n_layers - 1}" if layers == range(info.n_layers) else str(list(layers))
            raise AddressError(
                f"{format_address(address)!r}: layer {address.layer} is out of range; "
                f"{info.name} has layers {valid} for {address.name!r} (negative layers count from the end: "
                f"-1 is layer {info.n_layers - 1}, -{info.n_layers} is layer 0)"
            )
        if site.attention and info.attention_layers and address.layer not in info.attention_layers:
            kinds = ", ".join(f"{i} {kind}" for i, kind in enumerate(info.layer_kinds))
            raise AddressError(
                f"{format_address(address)!r}: layer {address.layer} of {info.name} is a "
                f"{info.layer_kinds[address.layer]} layer (its token mixer is not softmax attention), so "
                f"{address.name!r} exists only on its attention layers {list(info.attention_layers)} "
                f"(layers: {kinds}). "
                f"attn_out_post.{address.layer} is what that layer's token mixer adds to the residual"
            )
        if site.dense_mlp and address.layer in info.moe_layers:
            dense = [i for i in range(info.n_layers) if i not in info.moe_layers]
            where = f"exists on the dense layers {dense}" if dense else "exists on no layer of this model"
            raise AddressError(
                f"{format_address(address)!r}: layer {address.layer} of {info.name} is an MoE layer, whose experts "
                f"each have their own hidden activation, so {address.name!r} {where}. "
                f"For the routing use router_logits / expert_weights / expert_indices.{address.layer}"
            )
    if site.per_stream and not 0 <= address.stream < info.n_streams:
        what = "a single residual stream, so only stream 0" if info.n_streams == 1 else f"streams 0..{info.n_streams - 1}"
        raise AddressError(f"{format_address(address)!r}: {info.name} has {what}")


def from_the_end(address: Address, info: ModelInfo) -> Address:
    """``address`` with a negative layer (or stream) counted from the end of this model's layers
    (streams): ``resid_post.-1`` is ``resid_post.{n_layers - 1}``. Where the model is known — a
    capture's points, an edit's address, a cache lookup — addresses are normalised here, so what
    a cache holds and what crosses to workers and replicas always carries the real layer. A
    layer that is still negative is left for :func:`check_address` to refuse, naming the range."""
    if isinstance(address, FeatureAddress):  # a dictionary's point: its site counts from the end
        site = from_the_end(address.site, info)
        return address if site is address.site else dataclasses.replace(address, site=site)
    layer, stream = address.layer, address.stream
    if layer is not None and layer < 0 and layer + info.n_layers >= 0:
        layer += info.n_layers
    if stream is not None and stream < 0 and stream + info.n_streams >= 0:
        stream += info.n_streams
    if (layer, stream) == (address.layer, address.stream):
        return address
    return Address(address.name, layer, stream)


def _candidates(info: ModelInfo, site: Site, layer: int | None = None) -> list[Address]:
    if not site.per_layer:
        return [Address(site.name)]
    layers = range(info.n_layers) if layer is None else [layer]
    streams = range(info.n_streams) if site.per_stream else [None]
    return [Address(site.name, L, s) for L in layers for s in streams]


def _served(address: Address, info: ModelInfo, caps: Capabilities) -> bool:
    try:
        check_address(address, info, caps)
    except AddressError:
        return False
    return True


def all_points(info: ModelInfo, caps: Capabilities, site: str | None = None) -> list[Address]:
    """Every address the model serves on the backend of ``caps``, in forward order: ``embeddings``, then
    layer by layer, the sites of each layer in the order of :data:`SITES`, streams in order, ``logits`` last.
    ``site`` keeps one site's addresses (in layer order)."""
    site = our_name(site) if isinstance(site, str) else site
    if site is not None and site not in SITES:
        raise AddressError(unknown_site(site) if isinstance(site, str) else f"site must be a name, got {shown(site)}")
    sites = [SITES[site]] if site is not None else list(SITES.values())
    layered = [s for s in sites if s.per_layer]
    out = [Address(s.name) for s in sites if not s.per_layer and s.before_layers]
    out += [a for L in range(info.n_layers) for s in layered for a in _candidates(info, s, L)]
    out += [Address(s.name) for s in sites if not s.per_layer and not s.before_layers]
    return [a for a in out if _served(a, info, caps)]


def _expand(point, info: ModelInfo, caps: Capabilities) -> list[Address]:
    """One user point as addresses: a whole site (``"resid_post"``, ``"resid_streams.5"``) and a
    filter (a callable on Address) expand, in forward order; anything else is one address."""
    if callable(point) and not isinstance(point, (Address, FeatureAddress, str, tuple)):
        found = [a for a in all_points(info, caps) if point(a)]
        if not found:
            raise AddressError(
                f"the point filter {getattr(point, '__name__', point)!r} matched no address of {info.name} on the "
                f"{caps.name} backend; model.points() lists the valid ones (e.g. "
                f"{', '.join(format_address(a) for a in all_points(info, caps)[:3])}, ...)"
            )
        return found
    if isinstance(point, str):
        name, *coords = point.strip().split(".")
        name = our_name(name)
        site = SITES.get(name)
        whole = site is not None and ((site.per_layer and not coords) or (site.per_stream and len(coords) == 1))
        if whole:
            layer = None
            if coords:
                layer = from_the_end(parse_address(f"{name}.{coords[0]}.0"), info).layer
            candidates = _candidates(info, site, layer)
            if layer is not None:
                check_address(Address(name, layer, 0), info, caps)
            found = [a for a in candidates if _served(a, info, caps)]
            if not found:
                check_address(candidates[0], info, caps)  # raises the reason, with the options
            return found
    return [from_the_end(to_address(point), info)]


def _one_tuple(points) -> bool:
    """Whether ``points`` is one address in tuple form, ``(name, layer[, stream])``: the tuple
    ``to_address`` reads, so ``points=("resid_post", 1)`` is that one point, as ``"resid_post.1"``
    is (not the site ``resid_post`` and a point ``1``)."""
    return (isinstance(points, tuple) and 2 <= len(points) <= 3 and isinstance(points[0], str)
            and all(isinstance(x, numbers.Integral) or integer(x) is not None for x in points[1:]))


def check_points(points, info: ModelInfo, caps: Capabilities) -> list[Address]:
    """Turn the user's point list into Addresses, checked against the model.

    A point is an Address, its string form, a tuple, a whole site (``"resid_post"``: every
    layer; ``"resid_streams.5"``: every stream of layer 5) or a filter (a callable taking an
    Address). One point may be given without a list (``"resid_post.1"``, ``("resid_post", 1)``). Whole sites and filters expand in forward order (see :func:`all_points`), the same
    on every backend. Duplicates are dropped (the first occurrence keeps its place): asking twice
    for a point captures it once.
    """
    if isinstance(points, (str, Address, FeatureAddress)) or callable(points) or _one_tuple(points):
        points = [points]
    if not isinstance(points, Iterable) or isinstance(points, (bytes, bytearray, dict)):
        raise AddressError(
            f"points must be a list of addresses, e.g. ['resid_post.0'] or [Address('resid_post', 0)], "
            f"got {type(points).__name__} ({shown(points)})"
        )
    points = list(points)
    if not points:
        raise AddressError("no points to capture: pass e.g. ['resid_post.0'] or [Address('resid_post', 0)]")
    addresses = list(dict.fromkeys(a for p in points for a in _expand(p, info, caps)))
    for address in addresses:
        check_address(address, info, caps)
    return addresses
