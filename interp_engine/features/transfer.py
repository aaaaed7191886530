"""A sparse dictionary and its per-request work as they cross a process (the rules of
:mod:`interp_engine.wire`: only data, no code). To a vLLM worker a dictionary travels once per
engine, as its CPU tensors and options under its content key, and each request names it by that
key with its feature work (:func:`dictionary_for_worker`, :func:`features_for_worker`); to a
cluster replica it is put in Ray's object store once, its tensors as :class:`~interp_engine.wire.Packed`
arrays (:func:`put_dictionaries`)."""

from __future__ import annotations

import torch

from ..address import FeatureAddress, format_address, parse_address
from ..edits import Planned
from ..errors import InternalError
from ..positions import Selection
from ..wire import Packed, edit_for_worker, edit_from_worker
from .dictionary import Dictionary
from .plan import Attached

#: a dictionary's tensors (those it has), as they travel
_DICTIONARY_TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")
_DICTIONARY_OPTIONS = ("activation", "k", "apply_b_dec_to_input", "normalize", "norm_scale",
                       "rescale_by_decoder_norm", "name")


def dictionary_for_worker(dictionary) -> dict:
    """A :class:`~interp_engine.features.Dictionary` as plain data: its CPU tensors, its options
    and addresses as strings, and its content key (a worker keeps it under that key, so it is
    sent once per engine, not with every request)."""
    tensors = {n: getattr(dictionary, n).detach().to("cpu").contiguous() for n in _DICTIONARY_TENSORS
               if getattr(dictionary, n) is not None}
    options = {n: getattr(dictionary, n) for n in _DICTIONARY_OPTIONS}
    return {"key": dictionary.key, "tensors": tensors, "options": options,
            "reads": format_address(dictionary.reads), "writes": format_address(dictionary.writes)}


def dictionary_from_worker(data: dict):
    """The dictionary :func:`dictionary_for_worker` described."""
    tensors = data["tensors"]
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise InternalError("[Internal] a dictionary's weights reached the worker as something other than tensors")
    return Dictionary(**tensors, **data["options"], reads=parse_address(data["reads"]),
                      writes=parse_address(data["writes"]))


def features_for_worker(plan, row: int = 0) -> list[dict]:
    """The feature work of a checked call (a ``FeaturePlan``) for one of its rows, as plain data:
    per dictionary (by key) the feature points to record, whether its error term is recorded, and
    its feature and error edits (as :func:`edit_for_worker` writes edits)."""
    return [{"key": a.dictionary.key, "features": [format_address(p) for p in a.features], "error": a.error,
             "feature_edits": [{"point": format_address(p.address), **edit_for_worker(p, row)}
                               for p in a.feature_edits],
             "error_edit": None if a.error_edit is None else edit_for_worker(a.error_edit, row)}
            for a in plan.attached]


def features_from_worker(work: list[dict], dictionaries: dict) -> list:
    """The ``Attached`` items :func:`features_for_worker` described, with the worker's dictionaries
    (``{key: Dictionary}``; each was sent before the first request that uses it)."""
    def planned(point, data):
        positions, after = data.get("positions"), data.get("after")
        selection = None if positions is None and after is None else Selection((tuple(positions or ()),), (after,))
        return Planned(point, edit_from_worker(data), selection)

    out = []
    for item in work:
        d = dictionaries.get(item["key"])
        if d is None:
            raise InternalError(f"[Internal] dictionary {item['key']} was not sent to this worker before its request")
        edits = tuple(planned(parse_address(e["point"]), e) for e in item["feature_edits"])
        error = item["error_edit"]
        out.append(Attached(d, tuple(parse_address(p) for p in item["features"]), bool(item["error"]), edits,
                            None if error is None else planned(FeatureAddress(d.writes, "sae_error"), error)))
    return out


def dictionary_for_replica(dictionary) -> dict:
    """A dictionary as a cluster replica receives it: :func:`dictionary_for_worker`'s data with
    its tensors as :class:`Packed` numpy arrays (the cluster model puts it in the object store once)."""
    data = dictionary_for_worker(dictionary)
    return {**data, "tensors": {n: Packed.of(t) for n, t in data["tensors"].items()}}


def put_dictionaries(plan, held: dict[str, object]) -> list[tuple[str, object]]:
    """``[(key, object ref)]`` of a checked call's dictionaries (a ``FeaturePlan``), each put in
    Ray's object store once: ``held`` keeps the refs by key for the caller's later calls."""
    import ray

    for attached in plan.attached:
        d = attached.dictionary
        if d.key not in held:
            held[d.key] = ray.put(dictionary_for_replica(d))
    return [(a.dictionary.key, held[a.dictionary.key]) for a in plan.attached]


def dictionary_from_replica(data: dict):
    """The dictionary :func:`dictionary_for_replica` described."""
    return dictionary_from_worker({**data, "tensors": {n: p.tensor() for n, p in data["tensors"].items()}})
