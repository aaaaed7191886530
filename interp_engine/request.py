"""A capture request, checked once.

Everything a call asks for — the token batch, the points, the positions to keep, the edits, the
sampling options — is checked against the model by :meth:`CaptureModel.request` and held in one
:class:`Request`; a backend runs that value (:meth:`CaptureModel.execute`) and never checks it
again. The points inside are a :class:`Points`: addresses that :func:`~.points.check_points`
accepted for this model. Work split from one call — the batches of a dataset shard, the rows a
one-prompt engine runs, the share of a batch a cluster replica runs — carries those ``Points``
(or their strings, across a process boundary: :meth:`Points.trusted`), so however many pieces a
request is cut into, its points are checked once, where the user gave them.
"""

from __future__ import annotations

import dataclasses

import torch

from .address import Address, parse_address
from .points import ModelInfo, check_points
from .capabilities import Capabilities
from .edits import Planned
from .generation import Sampling
from .positions import Selection


class Points(tuple):
    """Addresses already checked against the model that runs them (a tuple of :class:`Address`).
    Passing one as ``points`` skips the check; build one with :meth:`check`, or with
    :meth:`trusted` for strings a driver checked against the same model."""

    __slots__ = ()

    @classmethod
    def check(cls, points, info: ModelInfo, caps: Capabilities) -> "Points":
        """``points`` as the user gave them, checked (see :func:`~.points.check_points`)."""
        return points if isinstance(points, Points) else cls(check_points(points, info, caps))

    @classmethod
    def trusted(cls, points) -> "Points":
        """Address strings (or Addresses) that the process which sent them checked against this
        same model: parsed, not checked again (a dataset shard, a cluster replica)."""
        return cls(p if isinstance(p, Address) else parse_address(p) for p in points)

    def strings(self) -> tuple[str, ...]:
        """The wire form (what :meth:`trusted` reads back)."""
        return tuple(str(a) for a in self)


@dataclasses.dataclass(frozen=True)
class Request:
    """One checked call: ``tokens`` ``[batch, pos]`` (padding -1), ``points``, ``positions``
    resolved against each row (None: every position), ``edits`` planned against the batch,
    ``options`` (None: a capture without generation), ``detach`` (eager: keep the graph when
    False)."""

    tokens: torch.Tensor
    points: Points
    positions: Selection | None = None
    #: per address, its planned edits in the order they apply
    edits: dict[Address, tuple[Planned, ...]] | None = None
    options: Sampling | None = None
    detach: bool = True
    #: the call's dictionaries with their feature points and edits (a features.plan.FeaturePlan;
    #: None: no feature work). Its points are not in ``points``: the dictionaries record them.
    features: object = None

    @property
    def generating(self) -> bool:
        return self.options is not None

    def for_replica(self) -> tuple[list[str], dict | None]:
        """The points (as strings) and planned edits a replica in another process receives: feature
        points and feature edits travel as points and edits, which the replica plans again with the
        dictionaries it is sent by key."""
        points, edits = list(self.points.strings()), self.edits
        if self.features is not None:
            points += [str(p) for p in self.features.points]
            edits = {**(edits or {}), **self.features.edit_map()}
        return points, edits
