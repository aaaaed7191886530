"""Edits on the wire: checked edits as plain data, for the processes that apply them elsewhere.

Two forms. :func:`wire` describes one planned edit for a vLLM worker (numbers and float32 CPU
tensors, which vLLM's ``collective_rpc`` carries as buffers, with a digest so that equal edits are
applied together), :func:`from_wire` reads it back. For a cluster replica, :func:`to_plain` keeps
the tensors as numpy arrays (what Ray returns zero-copy) and the positions spec as the user gave it
(each replica resolves it against its own rows), :func:`from_plain` reads it back. A tensor never
becomes a Python list on the way.
Only data crosses: a Python function edit is refused with an error that says what to use instead.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from .address import Address
from .edits import EDITS, Add, Edit, Planned, Scale, Set, Zero
from .positions import spec_to_json
from .errors import InputError, InternalError


def wire(planned: Planned, row: int = 0) -> dict:
    """One planned edit as plain data for a vLLM worker (numbers and CPU tensors; no code)."""
    edit = planned.edit
    out: dict = {"kind": type(edit).__name__.lower(), "heads": list(edit.heads) if edit.heads else None}
    digest = hashlib.blake2b(repr((out["kind"], out["heads"])).encode(), digest_size=16)
    if isinstance(edit, Add):
        out.update(vector=edit.vector.detach().to("cpu", torch.float32), shape=list(edit.vector.shape),
                   scale=edit.scale, norm_relative=edit.norm_relative)
        digest.update(repr((edit.scale, edit.norm_relative, out["shape"])).encode())
        digest.update(edit.vector.contiguous().numpy().tobytes())
    elif isinstance(edit, Scale):
        out["factor"] = edit.factor
        digest.update(repr(edit.factor).encode())
    elif isinstance(edit, Set):
        out.update(value=edit.value.detach().to("cpu", torch.float32), shape=list(edit.value.shape))
        digest.update(repr(out["shape"]).encode())
        digest.update(edit.value.contiguous().numpy().tobytes())
    #: equal edits have equal digests (a worker applies them to all their rows at once)
    out["digest"] = digest.hexdigest()
    sel = planned.selection
    out["positions"] = None if sel is None else list(sel.rows[row])
    out["after"] = None if sel is None else sel.after[row]
    return out


def from_wire(data: dict) -> Edit:
    """The edit :func:`wire` described (tensors float32, on the CPU)."""
    for key in ("vector", "value"):
        if key in data and not isinstance(data[key], torch.Tensor):
            raise InternalError(f"[Internal] an edit's {key} reached the worker as {type(data[key]).__name__}, "
                                f"not a tensor: edits travel as tensors (edits_wire.wire)")
    heads = tuple(data["heads"]) if data.get("heads") else None
    kind = data["kind"]
    if kind == "add":
        vector = data["vector"].to(torch.float32).reshape(data["shape"])
        return Add(vector, data["scale"], norm_relative=data["norm_relative"], heads=heads)
    if kind == "scale":
        return Scale(data["factor"], heads=heads)
    if kind == "set":
        return Set(data["value"].to(torch.float32).reshape(data["shape"]), heads=heads)
    if kind == "zero":
        return Zero(heads=heads)
    raise InternalError(f"[Internal] unknown edit kind {kind!r} on the wire")


def to_plain(planned: dict[Address, tuple[Planned, ...]] | None) -> dict | None:
    """Checked edits as plain data for a cluster replica: per address, a list of its edits in
    order (numbers, lists, numpy arrays, and each positions spec as given: each replica resolves
    it against its own rows). No code."""
    if not planned:
        return None
    return {str(address): [_plain(address, p) for p in chain] for address, chain in planned.items()}


def _plain(address: Address, p: Planned) -> dict:
    if not isinstance(p.edit, EDITS):
        raise InputError(f"edit on {address}: a Python function cannot be sent to cluster replicas (edits "
                         f"travel as data); use Add / Scale / Set / Zero, or a local eager model")
    if p.full:
        raise InputError(f"edit on {address}: a Set with a whole [batch, pos, ...] value cannot be split over "
                         f"cluster replicas; give one position's value with positions=, or run locally")
    data = wire(p)
    for key in ("vector", "value"):
        if key in data:
            data[key] = getattr(p.edit, key).numpy()
    data["positions"] = spec_to_json(p.edit.positions)
    data.pop("after")
    return data


def from_plain(plain: dict | None) -> dict[str, list[Edit]] | None:
    """The edits :func:`to_plain` described, ready for ``edits=`` on the replica's model."""
    if not plain:
        return None
    return {point: [_from_plain(data) for data in chain] for point, chain in plain.items()}


def _from_plain(data: dict) -> Edit:
    data = dict(data)
    for key in ("vector", "value"):
        if key in data:
            data[key] = torch.from_numpy(data[key].copy())
    edit = from_wire({**data, "heads": data.get("heads")})
    positions = data["positions"]
    if isinstance(positions, dict):
        positions = slice(*positions["slice"])
    return dataclasses.replace(edit, positions=positions)
