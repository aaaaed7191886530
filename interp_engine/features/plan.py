"""A call's dictionaries, checked once where the call enters: which feature points and feature
edits it asks for, and which dictionary serves each.

``saes=`` attaches dictionaries to one call. A dictionary serves the points at its sites: its
features where it reads (``resid_post.3.features``, ``resid_post.3.features[5,17]``) and its error
term where it writes (``resid_post.3.sae_error`` for an SAE, ``mlp_out.3.sae_error`` for a
transcoder reading ``resid_mid.3``). The same points take edits: ``Add`` / ``Scale`` / ``Set`` /
``Zero`` of chosen features (the error term kept), or of the error term (``Zero()`` on it splices
the reconstruction in place of the activation). :func:`plan_features` turns all of it into a
:class:`FeaturePlan`, the checked value the backends run (see :mod:`.run`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..address import SITES, Address, FeatureAddress, format_address, to_address
from ..points import ModelInfo
from ..edit_directions import DIRECTIONAL, plan_direction
from ..edits import EDITS, Add, Planned, Set, _fit, _number
from ..errors import AddressError, DictionaryError, InputError
from ..positions import check_spec, resolve
from .dictionary import Dictionary


@dataclasses.dataclass(frozen=True, eq=False)
class Attached:
    """One dictionary of a call and what the call asks of it."""

    dictionary: Dictionary
    #: feature points requested at its read site (each with its ids, or all)
    features: tuple[FeatureAddress, ...] = ()
    #: whether its error term is requested (at its write site)
    error: bool = False
    #: edits of its features (keyed by feature points, applied in order) and of its error term
    feature_edits: tuple[Planned, ...] = ()
    error_edit: Planned | None = None

    @property
    def edits(self) -> bool:
        return bool(self.feature_edits) or self.error_edit is not None

    @property
    def needs_error(self) -> bool:
        """Whether the reconstruction must be formed (the error term is read or edited)."""
        return self.error or self.error_edit is not None


@dataclasses.dataclass(frozen=True, eq=False)
class FeaturePlan:
    """The checked feature side of a call: the dictionaries that have work, in the order given."""

    attached: tuple[Attached, ...]
    #: the feature points, in the order requested (what the cache holds)
    points: tuple[FeatureAddress, ...]

    def sites(self) -> list[Address]:
        """Every address a dictionary of this call reads or writes."""
        out = []
        for a in self.attached:
            out += [a.dictionary.reads, a.dictionary.writes]
        return list(dict.fromkeys(out))

    @property
    def edits(self) -> bool:
        return any(a.edits for a in self.attached)

    def edit_map(self) -> dict:
        """Every feature and error edit of the call, by its feature point (what a cluster replica
        is sent as ``edits=``, with the dictionaries, to plan again)."""
        out = {}
        for a in self.attached:
            out.update({p.address: (p,) for p in a.feature_edits})
            if a.error_edit is not None:
                out[a.error_edit.address] = (a.error_edit,)
        return out


def site_width(address: Address, info: ModelInfo) -> int:
    """The length of the vector a dictionary sees at ``address`` (z: its heads flattened)."""
    if address.name == "z":
        return info.n_heads * info.d_head
    if "d_mlp" in SITES[address.name].shape:
        return info.d_mlp
    return info.d_model


def as_dictionaries(saes) -> tuple[Dictionary, ...]:
    """``saes=`` as a tuple: one Dictionary, or a list / tuple of them."""
    if saes is None:
        return ()
    items = [saes] if isinstance(saes, Dictionary) else saes
    if not isinstance(items, (list, tuple)) or not all(isinstance(d, Dictionary) for d in items):
        raise DictionaryError(f"saes= takes a Dictionary or a list of them (from load_dictionary(path)), got "
                              f"{type(saes).__name__}")
    return tuple(items)


def split_edits(edits) -> tuple[dict | None, dict]:
    """``edits=`` split into the plain edits (checked by :func:`interp_engine.edits.check_edits`)
    and the edits of feature points (checked here)."""
    if not isinstance(edits, dict):
        return edits, {}
    plain, features = {}, {}
    for key, edit in edits.items():
        try:
            address = to_address(key)
        except (AddressError, TypeError):
            address = None
        (features if isinstance(address, FeatureAddress) else plain)[key] = edit
    return plain or None, features


def plan_features(addresses: list, edits: dict, saes, info: ModelInfo, tokens: torch.Tensor, *,
                  writable: frozenset, generating: bool = False,
                  max_tokens: int | None = None) -> tuple[list[Address], FeaturePlan | None]:
    """The plain addresses of a checked point list, and the plan of its feature points and of
    the feature ``edits`` with the dictionaries ``saes`` (None when there is no feature work)."""
    dictionaries = as_dictionaries(saes)
    points = [a for a in addresses if isinstance(a, FeatureAddress)]
    plain = [a for a in addresses if not isinstance(a, FeatureAddress)]
    by_read, by_write = _index(dictionaries, info, writable)  # checked even when this call leaves them idle
    if not points and not edits:
        return plain, None
    lengths = (tokens >= 0).sum(dim=1).tolist()
    work: dict[int, dict] = {}

    def serving(point: FeatureAddress) -> Dictionary:
        table = by_read if point.kind == "features" else by_write
        found = table.get(point.site)
        if found is None:
            where = "reads" if point.kind == "features" else "writes"
            attached = ", ".join(repr(d) for d in dictionaries) or "none"
            raise AddressError(f"{format_address(point)!r} needs a dictionary that {where} {point.site}: pass one with "
                               f"saes=[load_dictionary(path)] (attached to this call: {attached})")
        if point.ids is not None and point.ids[-1] >= found.d_sae:
            raise AddressError(f"{format_address(point)!r}: feature {point.ids[-1]} is out of range; {found!r} has "
                               f"features 0..{found.d_sae - 1}")
        return found

    def entry(d: Dictionary) -> dict:
        return work.setdefault(id(d), {"dictionary": d, "features": [], "error": False, "feature_edits": [],
                                       "error_edit": None})

    for point in points:
        e = entry(serving(point))
        if point.kind == "features":
            e["features"].append(point)
        else:
            e["error"] = True
    for key, edit in edits.items():
        point = to_address(key)
        if isinstance(edit, (list, tuple)):  # the list form (a replica receives every edit as one)
            if len(edit) != 1:
                raise InputError(f"edits on {point}: a feature point takes one edit (a list of edits applies in "
                                 f"order on a model's own addresses), got {len(edit)}")
            (edit,) = edit
        d = serving(point)
        planned = _plan_edit(point, edit, d, tokens, lengths, generating, max_tokens)
        e = entry(d)
        if point.kind == "sae_error":
            if e["error_edit"] is not None:
                raise InputError(f"two edits on {point}: give one edit per address")
            e["error_edit"] = planned
        else:
            if any(p.address == point for p in e["feature_edits"]):
                raise InputError(f"two edits on {point}: give one edit per address")
            e["feature_edits"].append(planned)
    attached = tuple(Attached(e["dictionary"], tuple(e["features"]), e["error"], tuple(e["feature_edits"]),
                              e["error_edit"]) for e in work.values())
    for a in attached:
        if a.edits and a.dictionary.writes.name not in writable:
            raise AddressError(f"{a.dictionary!r} cannot edit: {a.dictionary.writes} is not writable on this "
                               f"backend (writable: {', '.join(sorted(writable))})")
    return plain, FeaturePlan(attached, tuple(points))


def _index(dictionaries, info: ModelInfo, writable) -> tuple[dict, dict]:
    """Each dictionary by the site it reads and the site it writes, checked against the model."""
    by_read: dict[Address, Dictionary] = {}
    by_write: dict[Address, Dictionary] = {}
    for d in dictionaries:
        for site, width, role in ((d.reads, d.d_in, "reads"), (d.writes, d.d_out, "writes")):
            if site.layer >= info.n_layers:
                raise DictionaryError(f"{d!r} {role} {site}, but {info.name} has layers 0..{info.n_layers - 1}")
            if site_width(site, info) != width:
                raise DictionaryError(f"{d!r} {role} vectors of {width}, but {site} of {info.name} is "
                                      f"{site_width(site, info)} wide: it was trained on another model or site")
        if d.reads in by_read or d.writes in by_write:
            other = by_read.get(d.reads) or by_write.get(d.writes)
            raise DictionaryError(f"{d!r} and {other!r} sit at the same address; attach one dictionary per site "
                                  f"to a call (make one call per dictionary to compare them)")
        if d.is_transcoder and (d.writes.layer, _ORDER.index(d.writes.name)) <= (d.reads.layer, _ORDER.index(d.reads.name)):
            raise DictionaryError(f"{d!r} writes {d.writes}, which the model computes before {d.reads}, where it "
                                  f"reads; a transcoder predicts a later address")
        by_read[d.reads] = d
        by_write[d.writes] = d
    return by_read, by_write


#: the order in which a layer computes the sites a dictionary sits at
_ORDER = ("resid_pre", "ln1_normalized", "attn_in", "z", "attn_out", "attn_out_post", "resid_mid", "ln2_normalized",
          "mlp_in", "mlp_pre", "mlp_pre_linear", "mlp_post", "mlp_out", "mlp_out_post", "resid_post", "resid_streams")


def _plan_edit(point: FeatureAddress, edit, d: Dictionary, tokens, lengths, generating, max_tokens) -> Planned:
    """An edit of a feature point, checked: its value fits one position's block (the selected
    features, or the error term's ``[d_out]``), its positions resolve against the batch."""
    if not isinstance(edit, EDITS):
        raise InputError(f"edit on {point}: {edit!r} is not an edit; feature points take Add(vector), Scale(factor), "
                         f"Set(value) or Zero() (with positions=)")
    if edit.heads is not None:
        raise InputError(f"edit on {point}: heads= applies to per-head sites; a feature point has no head axis")
    positions = check_spec(edit.positions)
    try:
        selection = resolve(positions, lengths, generating=generating, max_tokens=max_tokens)
    except InputError as error:
        raise InputError(f"edit on {point}: {error}") from None
    width = d.d_out if point.kind == "sae_error" else len(point.ids) if point.ids is not None else d.d_sae
    changes = {"positions": positions}
    if isinstance(edit, Add):
        if edit.norm_relative:
            raise InputError(f"edit on {point}: norm_relative applies to activations, not to feature values")
        changes["vector"] = _fit(point, "Add's vector", edit.vector, (width,))
        changes["scale"] = _number(point, "Add's scale", edit.scale)
    elif isinstance(edit, Set):
        changes["value"] = _fit(point, "Set's value", edit.value, (width,))
    elif hasattr(edit, "factor"):
        changes["factor"] = _number(point, "Scale's factor", edit.factor)
    elif isinstance(edit, DIRECTIONAL):  # a direction in the feature (or error term's) space
        changes.update(plan_direction(point, edit, (width,)))
    return Planned(point, dataclasses.replace(edit, **changes), selection)


def describe(dictionaries) -> list[dict]:
    """What a dataset manifest records about the dictionaries of its feature points (the content
    key tells a resume with other weights apart)."""
    return [{"name": d.name, "key": d.key, "reads": format_address(d.reads), "writes": format_address(d.writes),
             "d_sae": d.d_sae, "activation": d.activation} for d in dictionaries]


def sparse_point(address) -> bool:
    """Whether a dataset stores ``address`` sparse: all of a dictionary's features (a chosen
    subset ``features[...]`` and the error term are dense columns, like any activation)."""
    return isinstance(address, FeatureAddress) and address.kind == "features" and address.ids is None


def check_saes(model, addresses, saes) -> tuple[Dictionary, ...]:
    """The dictionaries a build attaches, checked against ``model`` and the feature points among
    ``addresses`` (each served by one of them); ``()`` when there are none."""
    dictionaries = as_dictionaries(saes)
    if not dictionaries and not any(isinstance(a, FeatureAddress) for a in addresses):
        return ()
    caps = model.capabilities
    plan_features(list(addresses), {}, dictionaries, model.info, torch.zeros(1, 1, dtype=torch.long),
                  writable=frozenset(caps.writable - caps.unserved))
    if dictionaries and not caps.features:
        raise InputError(f"dictionaries (saes=) do not run on the {model.backend} backend yet; load the model with "
                         f"backend='eager'")
    return dictionaries
