"""A call's dictionaries at work, in the process that makes the activations.

:class:`FeatureRun` turns a checked :class:`~.plan.FeaturePlan` into one
:class:`~interp_engine.edits.Transform` per site a dictionary works at. A backend installs them
as it installs edits, so each runs inside the hook that produces the activation (the eager
forward hooks, each vLLM worker's hooks): the features are encoded there, only what was asked
for leaves through ``sink(point, tensor)`` (``[batch, pos, n]``), and the activation goes on
changed only where the call edits it.

Edits keep what the dictionary misses. With features ``f``, edited features ``f'``, error term
``e = x - decode(f)`` and edited error ``e'``, the activation becomes
``x' = decode(f') + e' = x + (decode(f') - decode(f)) + (e' - e)``, computed in the second form:
where nothing is edited both differences are exactly zero and ``x`` is untouched. A transcoder
reads ``x`` at one site and predicts ``y`` at a later one: its features are read (and edited) at
the first, ``y' = y + (decode(f') - decode(f)) + (e' - e)`` with ``e = y - decode(f)`` at the second.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, defaultdict
from typing import Callable

import torch

from ..address import Address, FeatureAddress
from ..edits import Planned, Transform, edit_activation, edit_chain
from ..errors import InternalError
from .dictionary import Dictionary
from .plan import Attached, FeaturePlan

Sink = Callable[[FeatureAddress, torch.Tensor], None]


def _moved(planned: Planned, device: torch.device) -> Planned:
    """``planned`` with its edit's tensors on ``device`` (moved once per call, not per hook)."""
    edit = planned.edit
    moves = {f.name: getattr(edit, f.name).to(device) for f in dataclasses.fields(edit)
             if isinstance(getattr(edit, f.name), torch.Tensor)}
    return dataclasses.replace(planned, edit=dataclasses.replace(edit, **moves)) if moves else planned


class Placed:
    """Dictionaries kept on their device between calls, by content key (the last ``keep``), so a
    model on a GPU copies each dictionary's weights there once, not at every call."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._held: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, dictionary: Dictionary, device: torch.device) -> Dictionary:
        if dictionary.device == device:
            return dictionary
        key = (dictionary.key, str(device))
        with self._lock:
            held = self._held.pop(key, None) or dictionary.to(device)
            self._held[key] = held
            while len(self._held) > self.keep:
                self._held.popitem(last=False)
        return held

    def drop(self, key: str) -> None:
        """Forget the copies of the dictionary with content key ``key`` (a call using one keeps it)."""
        with self._lock:
            for held in [k for k in self._held if k[0] == key]:
                del self._held[held]


class DictionaryStep:
    """One attached dictionary during one call: its tensors on the device, and what its read
    site leaves for its write site within a forward (a transcoder)."""

    def __init__(self, attached: Attached, dictionary: Dictionary, device: torch.device):
        self.attached = attached
        self.d = dictionary
        self.error_point = FeatureAddress(dictionary.writes, "sae_error")
        self.columns = {p: torch.tensor(p.ids, device=device) for p in attached.features if p.ids is not None}
        self.feature_edits = [(_moved(p, device), None if p.address.ids is None
                               else torch.tensor(p.address.ids, device=device)) for p in attached.feature_edits]
        self.error_edit = None if attached.error_edit is None else _moved(attached.error_edit, device)
        self.pending: tuple | None = None

    def step(self, phase: str, x: torch.Tensor, start: int, sink: Sink) -> torch.Tensor:
        """Run ``phase`` (``"sae"``, or a transcoder's ``"read"`` / ``"write"``) on one forward's
        activation ``x`` ``[batch, pos, ...]``; the activation to carry on with."""
        flat = x.reshape(*x.shape[:2], -1)
        d, a = self.d, self.attached
        if phase == "write":
            if self.pending is None:
                raise InternalError(f"[Internal] {d!r}: its write site ran before its read site in this forward")
            prediction, change = self.pending
            self.pending = None
            if a.needs_error:
                change = self._error(flat.to(d.dtype) - prediction, change, start, sink)
            return self._apply(x, flat, change)
        normed = d.normalized(flat)
        f = d.activate(d.pre_activations(normed))
        edited = self._edit_features(f, start)
        for point in a.features:
            sink(point, edited if point.ids is None else edited.index_select(-1, self.columns[point]))
        change = None if edited is f else d.decode_change(edited - f, normed)
        if phase == "read":
            prediction = d.decode(f, normed, flat) if a.needs_error else None
            self.pending = (prediction, change)
            return x
        if a.needs_error:
            change = self._error(flat.to(d.dtype) - d.decode(f, normed), change, start, sink)
        return self._apply(x, flat, change)

    def _edit_features(self, f: torch.Tensor, start: int) -> torch.Tensor:
        for planned, columns in self.feature_edits:
            if columns is None:
                f = edit_activation(planned, f, start)
            else:
                f = f.index_copy(-1, columns, edit_activation(planned, f.index_select(-1, columns), start))
        return f

    def _error(self, error: torch.Tensor, change, start: int, sink: Sink):
        edited = error if self.error_edit is None else edit_activation(self.error_edit, error, start)
        if self.attached.error:
            sink(self.error_point, edited)
        if edited is error:
            return change
        return edited - error if change is None else change + (edited - error)

    def _apply(self, x: torch.Tensor, flat: torch.Tensor, change) -> torch.Tensor:
        if change is None:
            return x
        return (flat.to(self.d.dtype) + change).to(x.dtype).reshape(x.shape)


class SiteTransform(Transform):
    """Everything the call's dictionaries do at one site, in forward order: a plain edit of the
    site first, then each dictionary's step (a transcoder writing here before one reading here)."""

    def __init__(self, plain: tuple[Planned, ...] | None, steps: list[tuple[DictionaryStep, str]],
                 run: "FeatureRun"):
        self.plain = plain
        self.steps = steps
        self.run = run

    def edit_at(self, tensor: torch.Tensor, start: int) -> torch.Tensor:
        if self.plain is not None:
            tensor = edit_chain(self.plain, tensor, start)
        for state, phase in self.steps:
            tensor = state.step(phase, tensor, start, self.run.sink)
        return tensor


class FeatureRun:
    """One call's dictionaries, placed on ``device``: :meth:`edits` gives the edits to install.

    ``place(dictionary, device)`` puts a dictionary's tensors on the device (a backend passes one
    that keeps them there between calls); ``sink`` receives each feature point's tensor, and may be
    set after construction (the recorder it feeds is built from the edits)."""

    def __init__(self, plan: FeaturePlan, device, *, sink: Sink | None = None,
                 place: Callable[[Dictionary, torch.device], Dictionary] | None = None):
        device = torch.device(device)
        place = place or (lambda d, dev: d.to(dev))
        self.plan = plan
        self.sink = sink
        self.states = [DictionaryStep(a, place(a.dictionary, device), device) for a in plan.attached]

    def edits(self, plain: dict[Address, tuple[Planned, ...]] | None) -> dict[Address, tuple[Planned, ...]]:
        """The call's plain edits with a :class:`SiteTransform` at every site a dictionary works at
        (the plain edits of that site run inside it, first, in their order)."""
        out = dict(plain or {})
        for site, todo in steps_at(self.states).items():
            out[site] = (Planned(site, SiteTransform(out.get(site), todo, self)),)
        return out


def steps_at(steps: list[DictionaryStep]) -> dict[Address, list[tuple[DictionaryStep, str]]]:
    """Where each dictionary works and in what role: an SAE once at its site (``"sae"``), a
    transcoder at its read site and, when its error or edits are needed, at its write site; at a
    site, a transcoder writing there runs before one reading there."""
    at: dict[Address, list] = defaultdict(list)
    for step in steps:
        d, a = step.d, step.attached
        if not d.is_transcoder:
            at[d.reads].append((step, "sae"))
            continue
        at[d.reads].append((step, "read"))
        if a.needs_error or a.edits:
            at[d.writes].insert(0, (step, "write"))
    return dict(at)
