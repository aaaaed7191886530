"""Addresses: the names of the points in a model where activations can be read.

An address is a value: ``Address(name, layer, stream)``. Its string form is
``name.layer[.stream]`` (``"resid_post.10"``, ``"resid_streams.5.2"``), or the bare name for
model-level points (``"logits"``). The same address means the same tensor on every backend.

Which names exist, and which of them take a layer or a stream, is the table ``SITES`` below.
Whether a given model serves a site (dense or MoE, how many layers and streams, which backend)
is checked by :func:`interp_engine.points.check_points` against the model's
:class:`~interp_engine.points.ModelInfo`.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from .sites import SITES as SITES
from .sites import Site as Site
from .errors import AddressError, shown
from .scalars import integer
from .tl_names import from_tl_name, is_tl_name
from .vocab import ALIASES, unknown_site


@dataclasses.dataclass(frozen=True, order=True)
class Address:
    """One capture point: ``Address("resid_post", 10)``, ``Address("logits")``,
    ``Address("resid_streams", 5, 2)``."""

    name: str
    layer: int | None = None
    stream: int | None = None

    def __post_init__(self):
        if isinstance(self.name, str) and self.name in ALIASES:  # the peer's exact synonyms: the same point
            object.__setattr__(self, "name", ALIASES[self.name])
        if self.name not in SITES:
            raise AddressError(unknown_site(self.name) if isinstance(self.name, str)
                               else f"a site name is a string such as 'resid_post', got {shown(self.name)}")
        site = SITES[self.name]
        for field in ("layer", "stream"):
            value = getattr(self, field)
            if value is not None:
                if integer(value) is None:
                    raise AddressError(f"{field} of {self.name!r} must be an int, got {shown(value)}")
                object.__setattr__(self, field, integer(value))
        if site.per_layer and self.layer is None:
            raise AddressError(f"{self.name!r} needs a layer, e.g. Address({self.name!r}, 0)")
        if not site.per_layer and self.layer is not None:
            raise AddressError(f"{self.name!r} is model-level and takes no layer: Address({self.name!r})")
        if site.per_stream and self.stream is None:
            raise AddressError(f"{self.name!r} needs a stream, e.g. Address({self.name!r}, 0, 0)")
        if not site.per_stream and self.stream is not None:
            raise AddressError(f"{self.name!r} takes no stream; only 'resid_streams' does")

    def __str__(self) -> str:
        return format_address(self)

    @property
    def position_axes(self) -> tuple[int, ...]:
        """The axes of this address's ``[batch, ...]`` tensor that run over positions, the query
        (or only) axis first: ``(1,)``, or ``(2, 3)`` for ``pattern`` ``[b, heads, q, k]``."""
        return SITES[self.name].position_axes

    @property
    def query_axis(self) -> int:
        """The axis that runs over the positions a token's row is read at (``positions=`` selects on it)."""
        return SITES[self.name].position_axes[0]


#: what a dictionary attached to a call makes addressable at a site (see interp_engine.features)
FEATURE_KINDS = ("features", "sae_error")


@dataclasses.dataclass(frozen=True)
class FeatureAddress:
    """A point a sparse dictionary adds at a site: its feature activations where it reads
    (``"resid_post.3.features"``; a subset of feature ids: ``"resid_post.3.features[5,17]"``,
    ids sorted, each once) or its error term where it writes (``"mlp_out.3.sae_error"``: the
    activation minus the dictionary's reconstruction). Only a call that attaches a dictionary
    there (``saes=``) serves it."""

    site: Address
    kind: str = "features"
    ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.site, Address) or self.site.layer is None:
            raise AddressError(f"a feature point sits at a layer's address such as Address('resid_post', 3), "
                               f"got {self.site!r}")
        if self.kind not in FEATURE_KINDS:
            raise AddressError(f"unknown feature point {self.kind!r}; known: {', '.join(FEATURE_KINDS)}")
        if self.ids is not None:
            ids = [self.ids] if integer(self.ids) is not None else self.ids
            if self.kind != "features":
                raise AddressError(f"{self.kind!r} takes no feature ids; only 'features[...]' selects some")
            try:
                ids = list(ids)
            except TypeError:
                ids = [ids]
            bad = [i for i in ids if integer(i) is None or integer(i) < 0]
            if not ids or bad:
                raise AddressError(f"feature ids must be a non-empty list of non-negative ints, got {self.ids!r}")
            object.__setattr__(self, "ids", tuple(sorted({integer(i) for i in ids})))

    def __str__(self) -> str:
        return format_address(self)

    # what code written for an Address reads: where the point sits, and its axes
    @property
    def name(self) -> str:
        return self.kind

    @property
    def layer(self) -> int:
        return self.site.layer

    @property
    def stream(self) -> int | None:
        return self.site.stream

    position_axes = (1,)
    query_axis = 1


AddressLike = Union[Address, FeatureAddress, str, tuple]


def format_address(address: Address | FeatureAddress, style: str = "ours") -> str:
    """``Address("z", 7)`` -> ``"z.7"``; the inverse of :func:`parse_address`.
    ``style="tl"``: the TransformerLens hook name, ``"blocks.7.attn.hook_z"`` (see :mod:`.tl_names`)."""
    if style == "tl":
        from .tl_names import tl_name

        if isinstance(address, FeatureAddress):  # the site's hook name, then the feature part as ours
            return tl_name(address.site) + format_address(address)[len(format_address(address.site)):]
        return tl_name(address)
    if style != "ours":
        raise AddressError(f"format_address: style must be 'ours' ('z.7') or 'tl' ('blocks.7.attn.hook_z'), "
                           f"got {style!r}")
    if isinstance(address, FeatureAddress):
        ids = "" if address.ids is None else f"[{','.join(map(str, address.ids))}]"
        return f"{format_address(address.site)}.{address.kind}{ids}"
    parts = [address.name]
    parts += [str(x) for x in (address.layer, address.stream) if x is not None]
    return ".".join(parts)


def parse_address(text: str) -> Address:
    """``"resid_post.10"`` -> ``Address("resid_post", 10)``; the inverse of :func:`format_address`.
    A TransformerLens hook name (``"blocks.10.hook_resid_post"``) reads as the same address
    (:func:`.tl_names.from_tl_name`)."""
    if not isinstance(text, str):
        raise AddressError(f"parse_address takes a string like 'resid_post.10', got {type(text).__name__}")
    site, _, last = text.strip().rpartition(".")
    if site and last.split("[")[0] in FEATURE_KINDS:
        return _parse_feature(text, parse_address(site), last)
    if is_tl_name(text.strip()):
        return Address(*from_tl_name(text))
    name, *coords = text.strip().split(".")
    if coords and coords[-1].startswith("stream-"):
        return _stream_form(text, name, coords)
    try:
        numbers = [int(c) for c in coords]
    except ValueError:
        raise AddressError(
            f"cannot parse {text!r}: the form is name.layer[.stream] with integer coordinates, "
            f"e.g. 'resid_post.10' or 'resid_streams.5.2'"
        ) from None
    if len(numbers) > 2:
        raise AddressError(f"cannot parse {text!r}: at most a layer and a stream follow the name")
    return Address(name, *numbers)


#: the residual points decoderesearch's interp-engine qualifies by a stream (``resid_post.5.stream-2``)
#: -> which ``resid_streams`` layer holds that stream, relative to the point's layer (None: none does)
_STREAM_OF = {"resid_post": 0, "resid_pre": -1, "resid_mid": None}


def _stream_form(text: str, name: str, coords: list[str]) -> Address:
    """The peer's string form ``resid_post.L.stream-S``: stream S of a multi-stream residual, our
    ``resid_streams.L.S`` (``resid_pre.L.stream-S`` is ``resid_streams.(L-1).S``)."""
    try:
        layer, stream = int(coords[0]), int(coords[1][len("stream-"):])
        if len(coords) != 2:
            raise ValueError
    except (ValueError, IndexError):
        raise AddressError(f"cannot parse {text!r}: the stream form is name.layer.stream-S, e.g. "
                           f"'resid_post.5.stream-2' (here: 'resid_streams.5.2')") from None
    if name not in _STREAM_OF:
        raise AddressError(f"cannot parse {text!r}: only resid_pre / resid_post take a stream-S coordinate; "
                           f"the streams after layer L are resid_streams.L.S")
    shift = _STREAM_OF[name]
    if shift is None:
        raise AddressError(f"{text!r}: there is no one stream stack between a multi-stream layer's two blocks to "
                           f"read stream {stream} of; the streams after layer {layer} are "
                           f"'resid_streams.{layer}.{stream}' (see docs/MOE.md)")
    if layer + shift < 0 <= layer:
        raise AddressError(f"{text!r}: the streams entering layer 0 (the embedding's) are not a point; the streams "
                           f"after layer 0 are 'resid_streams.0.{stream}'")
    return Address("resid_streams", layer + shift, stream)


def _parse_feature(text: str, site: Address, last: str) -> FeatureAddress:
    """``"features[5,17]"`` / ``"sae_error"`` after a site's address."""
    kind, bracket, rest = last.partition("[")
    if not bracket:
        return FeatureAddress(site, kind)
    try:
        if not rest.endswith("]"):
            raise ValueError
        ids = [int(i) for i in rest[:-1].split(",")]
    except ValueError:
        raise AddressError(f"cannot parse {text!r}: feature ids are written {kind}[5,17] (ints, no spaces needed)") from None
    return FeatureAddress(site, kind, tuple(ids))


def to_address(point: AddressLike) -> Address | FeatureAddress:
    """Accept an Address, its string form, or a tuple ``(name, layer[, stream])``."""
    if isinstance(point, (Address, FeatureAddress)):
        return point
    if isinstance(point, str):
        return parse_address(point)
    if isinstance(point, tuple) and point and isinstance(point[0], str):
        return Address(*point)
    raise AddressError(
        f"cannot read {shown(point)} as an address: use Address('resid_post', 10), "
        f"'resid_post.10' or ('resid_post', 10)"
    )
