"""Directional edits: edits that act on an activation's component along a direction.

Steering and ablation methods mostly change one direction of an activation and leave the rest:
refusal-direction ablation, activation (projection) capping, replacing a concept's component,
rotating toward a concept. Each edit here takes a ``direction`` ``d`` the size of one position's
block (``[d_model]`` on a residual site, ``[d_head]`` or ``[n_heads, d_head]`` on ``z`` / ``q`` /
``k`` / ``v``, ``[d_mlp]`` on ``mlp_post``), broadcast like ``Add``'s vector. The arithmetic runs
over the block's last axis (a residual row; each head's own vector), in float32, with

    d̂ = d / |d|        p = x · d̂   (the projection of x on d̂, one number per vector)

- ``Ablate(d)``: ``x - p d̂`` — the component along d̂ removed (directional ablation);
- ``Cap(d, max=a, min=b)``: ``x + (clamp(p, b, a) - p) d̂`` — the projection held within
  ``[min, max]`` (either bound may be left out), the orthogonal part untouched;
- ``Swap(d, projection=v)``: ``x + (v - p) d̂`` — the component along d̂ replaced by ``v d̂``
  (the projection set to ``v``; ``v`` taken from another prompt's capture swaps a concept in);
- ``Rotate(d, angle=θ)``: ``x`` turned by ``θ`` radians in the plane of ``x`` and d̂, toward d̂
  (away from it for ``θ < 0``), its norm kept. With ``u = x / |x|``, ``w = d̂ - (d̂ · u) u`` and
  the angle from ``x`` to d̂ ``φ = atan2(|w|, d̂ · u)`` in ``[0, π]``: ``x' = |x| (cos t u + sin t
  w / |w|)`` with ``t = clamp(θ, φ - π, φ)``, so the rotation stops at d̂ (at ``-d̂`` going away):
  ``Rotate(d, angle=math.pi)`` gives ``|x| d̂``. Where ``x`` is 0 or parallel to d̂ (``|w| = 0``)
  no plane is defined and ``x`` is kept.

A norm-relative add, ``x + scale |x| d̂``, is ``Add(d, scale, norm_relative=True)``.

Like every edit they take ``positions=`` and, on the per-head sites, ``heads=``; they travel as
data (a direction tensor and numbers) to vLLM workers, cluster replicas and the service.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .edit_values import number, tensor
from .errors import InputError


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Ablate:
    """``x - (x·d̂) d̂``: the component along ``direction`` removed."""

    direction: object
    positions: object = None
    heads: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Cap:
    """``x + (clamp(x·d̂, min, max) - x·d̂) d̂``: the projection on ``direction`` held in
    ``[min, max]`` (give either bound or both)."""

    direction: object
    max: float | None = None
    min: float | None = None
    positions: object = None
    heads: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Swap:
    """``x + (projection - x·d̂) d̂``: the component along ``direction`` replaced by
    ``projection * d̂``."""

    direction: object
    projection: float
    positions: object = None
    heads: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Rotate:
    """``x`` rotated by ``angle`` radians toward ``direction`` in the plane of the two, its norm
    kept; the rotation stops at the direction (see the module's definition)."""

    direction: object
    angle: float = 0.0
    positions: object = None
    heads: tuple | None = None


DIRECTIONAL = (Ablate, Cap, Swap, Rotate)
#: each directional kind's numbers (besides its direction), as they travel on the wire
NUMBERS = {"ablate": (), "cap": ("max", "min"), "swap": ("projection",), "rotate": ("angle",)}
#: the edit class of each wire kind
KINDS = {cls.__name__.lower(): cls for cls in DIRECTIONAL}


def plan_direction(address, edit, block: tuple[int, ...]) -> dict:
    """The checked fields of a directional ``edit`` of one position's ``block`` at ``address``:
    its direction as a float32 tensor that broadcasts to the block (its last axis the block's,
    each vector nonzero) and its numbers as floats."""
    kind = type(edit).__name__
    if getattr(address, "name", None) == "pattern":
        raise InputError(f"edit on {address}: {kind} acts on a vector's direction; a pattern row is attention "
                         f"probabilities (edit z.{address.layer}, q / k / v, or use Scale / Set / Zero on pattern)")
    direction = tensor(address, f"{kind}'s direction", edit.direction)
    shape = tuple(direction.shape)
    fits = (1 <= len(shape) <= len(block) and shape[-1] == block[-1]
            and all(s in (1, b) for s, b in zip(shape[::-1], block[::-1])))
    if not fits:
        wanted = f"[{', '.join(map(str, block))}]"
        raise InputError(f"edit on {address}: {kind}'s direction of shape {list(shape)} does not fit: each edited "
                         f"position of {address.name} is {wanted}, and a direction is a vector of its last axis "
                         f"([{block[-1]}], or one per head {wanted}); one direction serves every row")
    norms = direction.norm(dim=-1)
    if not bool((norms > 0).all()) or not bool(torch.isfinite(norms).all()):
        raise InputError(f"edit on {address}: {kind}'s direction needs a finite nonzero norm (only its direction "
                         f"is used: d / |d|); got a norm of {float(norms.min()):g}: pass a nonzero vector (divide a "
                         f"huge one by its largest value first)")
    changes = {"direction": direction}
    for name in NUMBERS[kind.lower()]:
        value = getattr(edit, name)
        if value is not None or not isinstance(edit, Cap):  # only a Cap's bounds may be left out
            changes[name] = number(address, f"{kind}'s {name}", value)
    if isinstance(edit, Cap):
        low, high = changes.get("min"), changes.get("max")
        if low is None and high is None:
            raise InputError(f"edit on {address}: Cap needs a bound: Cap(direction, max=...) caps the projection "
                             f"from above, min= from below, both hold it in a range")
        if low is not None and high is not None and low > high:
            raise InputError(f"edit on {address}: Cap's min={low:g} is above its max={high:g}; give min <= max")
    return changes


def change(edit, x: torch.Tensor) -> torch.Tensor:
    """The directionally edited ``x`` (``[..., n]`` with ``n`` the direction's last axis); a new
    tensor in ``x``'s dtype. The module docstring defines each kind."""
    d = edit.direction.to(x.device, torch.float32)
    unit = d / d.norm(dim=-1, keepdim=True)
    v = x.float()
    p = (v * unit).sum(dim=-1, keepdim=True)
    if isinstance(edit, Ablate):
        new = v - p * unit
    elif isinstance(edit, Cap):
        new = v + (p.clamp(min=edit.min, max=edit.max) - p) * unit
    elif isinstance(edit, Swap):
        new = v + (edit.projection - p) * unit
    else:
        new = _rotate(v, unit, edit.angle)
    return new.to(x.dtype)


def _rotate(v: torch.Tensor, unit: torch.Tensor, angle: float) -> torch.Tensor:
    norm = v.norm(dim=-1, keepdim=True)
    u = v / norm.clamp_min(torch.finfo(torch.float32).tiny)
    c = (u * unit).sum(dim=-1, keepdim=True)
    w = unit - c * u
    s = w.norm(dim=-1, keepdim=True)
    phi = torch.atan2(s, c)
    t = torch.minimum(torch.maximum(torch.full_like(phi, angle), phi - math.pi), phi)
    turned = norm * (torch.cos(t) * u + torch.sin(t) * w / s.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.where((s > 0) & (norm > 0), turned, v)


def for_wire(edit) -> dict:
    """A checked directional edit's kind-specific fields as plain data: its direction (a float32
    CPU tensor) and shape, and its numbers."""
    out = {"direction": edit.direction.detach().to("cpu", torch.float32), "shape": list(edit.direction.shape)}
    for name in NUMBERS[type(edit).__name__.lower()]:
        out[name] = getattr(edit, name)
    return out


def from_wire(kind: str, data: dict, heads):
    """The directional edit :func:`for_wire` described."""
    direction = data["direction"].to(torch.float32).reshape(data.get("shape", data["direction"].shape))
    return KINDS[kind](direction, **{name: data.get(name) for name in NUMBERS[kind]}, heads=heads)

