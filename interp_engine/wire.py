"""Everything that crosses a process boundary, in one place: what it looks like on the wire.

Three boundaries, one rule: only data crosses (numbers, strings, lists of ints, numpy arrays and
CPU tensors); no code and no pickled objects, so a replica or a vLLM worker can never be made to
run something it was sent.

- **Tensors** (:class:`Packed`): a numpy array plus the torch dtype it came from. Ray returns
  numpy arrays zero-copy out of its object store; a dtype numpy lacks (bfloat16) travels as its
  raw 16-bit pattern and is viewed back on arrival, so nothing is rounded.
- **To a vLLM worker** (``collective_rpc``, msgpack between processes under tensor parallelism):
  a :class:`WorkerRequest` per engine request (the points to record, the positions to keep, its
  edits, its dictionaries' work). Edits travel as float32 CPU tensors, which vLLM carries as
  buffers, never as lists (:func:`edit_for_worker` / :func:`edit_from_worker`); a sparse
  dictionary travels once per engine, as its tensors and options, and requests name it by its
  content key (:mod:`interp_engine.features.transfer`).
- **To and from a cluster replica** (Ray): checked edits with their positions spec as the user
  gave it (:func:`edits_for_replica` / :func:`edits_from_replica`: each replica resolves the spec
  against its own rows), results as :class:`CaptureReply` / :class:`GenerationReply`, and errors relabelled
  with where they happened (:func:`relabel`). The dataset manifest stores a positions spec in the
  same JSON form (:func:`spec_to_json` / :func:`spec_from_json`).

An HTTP front end reuses these forms: a message that is plain data here is plain data there.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from .address import Address, format_address, parse_address
from .dtypes import as_bfloat16, bf16_bits, dtype_name
from .edit_directions import DIRECTIONAL, KINDS, for_wire, from_wire
from .edit_rows import one_row
from .edits import EDITS, Add, Edit, Planned, Scale, Set, Zero
from .errors import InputError, InternalError, RemoteError, shown

# -- tensors ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Packed:
    """A tensor as a numpy array plus the torch dtype it came from."""

    array: np.ndarray
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Packed":
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            return cls(bf16_bits(tensor).numpy(), "bfloat16")
        return cls(tensor.numpy(), dtype_name(tensor.dtype))

    def tensor(self) -> torch.Tensor:
        # Arrays out of the object store are read-only; the copy gives the user a tensor they own.
        out = torch.from_numpy(np.array(self.array, copy=True))
        return as_bfloat16(out) if self.dtype == "bfloat16" else out

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


@dataclasses.dataclass(frozen=True)
class SparsePacked:
    """A dictionary's feature tensor ``[*shape, width]`` as its active entries only (compressed
    rows, :class:`~interp_engine.features.sparse.SparseRows`), so a replica's reply carries the
    features that fired and nothing else; :meth:`tensor` gives the dense tensor back."""

    offsets: np.ndarray
    ids: np.ndarray
    values: Packed
    shape: tuple[int, ...]
    width: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "SparsePacked":
        from .features.sparse import SparseRows

        rows = SparseRows.of(tensor).cpu()
        return cls(rows.offsets.numpy(), rows.ids.numpy(), Packed.of(rows.values), tuple(tensor.shape[:-1]),
                   int(tensor.shape[-1]))

    def tensor(self) -> torch.Tensor:
        from .features.sparse import SparseRows

        rows = SparseRows(torch.from_numpy(np.array(self.offsets, copy=True)),
                          torch.from_numpy(np.array(self.ids, copy=True)), self.values.tensor(), self.width)
        return rows.dense(self.shape)

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.ids.nbytes + self.values.nbytes


def pack_dict(data: dict[Address, torch.Tensor]) -> dict[str, Packed]:
    """Tensors by address string; a dictionary's whole feature vector travels sparse."""
    from .features.plan import sparse_point

    return {format_address(a): SparsePacked.of(t) if sparse_point(a) else Packed.of(t) for a, t in data.items()}


def unpack_dict(data: dict[str, Packed]) -> dict[Address, torch.Tensor]:
    return {parse_address(k): v.tensor() for k, v in data.items()}


# -- positions specs ----------------------------------------------------------------------------


def spec_to_json(spec):
    """A checked ``positions=`` spec as JSON data (a slice becomes ``{"slice": [start, stop, step]}``)."""
    if isinstance(spec, slice):
        return {"slice": [spec.start, spec.stop, spec.step]}
    return spec


def spec_from_json(data):
    """The spec :func:`spec_to_json` described."""
    if isinstance(data, dict):
        return slice(*data["slice"])
    return data


# -- to a vLLM worker ---------------------------------------------------------------------------


def edit_for_worker(planned: Planned, row: int = 0) -> dict:
    """One planned edit as plain data for a vLLM worker: its kind, heads, numbers, float32 CPU
    tensors, the positions of ``row`` it applies to, and a digest (equal edits have equal digests;
    a worker applies them to all their rows at once)."""
    edit, positions, per_position = one_row(planned, row)
    out: dict = {"kind": type(edit).__name__.lower(), "heads": list(edit.heads) if edit.heads else None}
    if per_position:  # a value per edited position, in the order of ``positions``
        out["per_position"] = True
    digest = hashlib.blake2b(repr((out["kind"], out["heads"], per_position)).encode(), digest_size=16)
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
    elif isinstance(edit, DIRECTIONAL):
        out.update(for_wire(edit))
        digest.update(repr({k: v for k, v in out.items() if k != "direction"}).encode())
        digest.update(out["direction"].contiguous().numpy().tobytes())
    out["digest"] = digest.hexdigest()
    sel = planned.selection
    out["positions"] = positions
    out["after"] = None if sel is None else sel.after[row]
    return out


#: the fields of an edit's wire form that hold tensors
TENSOR_FIELDS = ("vector", "value", "direction")


def edit_from_worker(data: dict) -> Edit:
    """The edit :func:`edit_for_worker` described (tensors float32, on the CPU)."""
    for key in TENSOR_FIELDS:
        if key in data and not isinstance(data[key], torch.Tensor):
            raise InternalError(f"[Internal] an edit's {key} reached the worker as {type(data[key]).__name__}, "
                                f"not a tensor: edits travel as tensors (wire.edit_for_worker)")
    kind = data.get("kind")
    if kind not in _EDIT_FIELDS:
        raise InputError(f"an edit's kind must be one of {', '.join(map(repr, _EDIT_FIELDS))}, got {shown(kind)}")
    needed = _EDIT_FIELDS[kind]
    if needed and data.get(needed[0]) is None:
        raise InputError(f"{kind!r} edit without {needed[0]!r}: it needs {needed[1]}")
    heads = tuple(data["heads"]) if data.get("heads") else None
    if kind == "add":
        vector = data["vector"].to(torch.float32).reshape(data.get("shape", data["vector"].shape))
        return Add(vector, data.get("scale", 1.0), norm_relative=data.get("norm_relative", False), heads=heads)
    if kind == "scale":
        return Scale(data["factor"], heads=heads)
    if kind == "set":
        return Set(data["value"].to(torch.float32).reshape(data.get("shape", data["value"].shape)), heads=heads)
    if kind == "zero":
        return Zero(heads=heads)
    return from_wire(kind, data, heads)


#: the field each edit kind cannot go without on the wire, and what it is (for the error naming it)
_EDIT_FIELDS = {"add": ("vector", "the vector it adds to each edited position, as Add(vector, scale=1.0)"),
                "scale": ("factor", "the number it multiplies by, as Scale(factor)"),
                "set": ("value", "the value it writes in place of each edited position, as Set(value)"),
                "zero": (),
                **{kind: ("direction", f"the direction it acts along, as {cls.__name__}(direction, ...)")
                   for kind, cls in KINDS.items()}}


@dataclasses.dataclass(frozen=True)
class WorkerRequest:
    """What a vLLM worker is told about one engine request before it is first scheduled: the
    points to record (address strings, as the worker's site table names them), the prompt
    positions to keep (``positions``; every position from ``after`` on too; None: all rows) and
    its edits (``{address: [edit_for_worker(...), ...]}``, in the order they apply). Travels as
    :meth:`to_rpc`'s plain dict."""

    points: tuple[str, ...] = ()
    positions: tuple[int, ...] | None = None
    after: int | None = None
    edits: dict[str, dict] | None = None
    #: the work of the request's dictionaries (:func:`features_for_worker`), or None
    features: list[dict] | None = None

    def to_rpc(self) -> dict:
        return {"points": list(self.points), "positions": None if self.positions is None else list(self.positions),
                "after": self.after, "edits": self.edits, "features": self.features}

    @classmethod
    def from_rpc(cls, data: dict) -> "WorkerRequest":
        if not isinstance(data, dict) or set(data) - {"points", "positions", "after", "edits", "features"}:
            raise InternalError(f"[Internal] a worker request must be WorkerRequest.to_rpc()'s dict, got {data!r:.200}")
        positions = data.get("positions")
        return cls(tuple(data.get("points") or ()), None if positions is None else tuple(positions),
                   data.get("after"), data.get("edits") or None, data.get("features") or None)

    @property
    def empty(self) -> bool:
        """Nothing to record and nothing to edit: plain generation, nothing to register."""
        return not self.points and not self.edits and not self.features


# -- to and from a cluster replica --------------------------------------------------------------


def edits_for_replica(planned: dict[Address, tuple[Planned, ...]] | None) -> dict | None:
    """Checked edits as plain data for a cluster replica: per address, its edits in the order they
    apply (numbers, numpy arrays, and each positions spec as given: each replica resolves it
    against its own rows). No code."""
    if not planned:
        return None
    return {str(address): [_for_replica(address, p) for p in chain] for address, chain in planned.items()}


def _for_replica(address: Address, p: Planned) -> dict:
    if not isinstance(p.edit, EDITS):
        raise InputError(f"edit on {address}: a Python function cannot be sent to cluster replicas (edits "
                         f"travel as data); use Add / Scale / Set / Zero or a directional edit, or a local eager model")
    data = edit_for_worker(dataclasses.replace(p, per_row=0))
    data.pop("per_position", None)
    for key in TENSOR_FIELDS:
        if key in data:
            data[key] = getattr(p.edit, key).numpy()
            data["shape"] = list(data[key].shape)
    data["positions"] = spec_to_json(p.edit.positions)
    data["rows"] = p.per_row  # leading per-row axes: split with the rows (edits_for_rows)
    data.pop("after")
    return data


def edits_for_rows(plain: dict | None, start: int, stop: int, width: int | None = None) -> dict | None:
    """:func:`edits_for_replica`'s edits for rows ``start:stop`` of the batch: a value per row is
    cut to those rows (and a value for every position to ``width``, the rows' own width where a
    one-prompt replica runs a row unpadded)."""
    if not plain:
        return plain
    out = {}
    for point, chain in plain.items():
        out[point] = []
        for data in chain:
            if data.get("rows"):
                data = dict(data)
                key = "vector" if "vector" in data else "value"
                part = data[key][start:stop]
                if data["rows"] == 2 and data["positions"] is None and width is not None:
                    part = part[:, :width]
                data[key], data["shape"] = part, list(part.shape)
            out[point].append(data)
    return out


def edits_from_replica(plain: dict | None) -> dict[str, list[Edit]] | None:
    """The edits :func:`edits_for_replica` described, ready for ``edits=`` on the replica's model."""
    if not plain:
        return None
    return {point: [_from_replica(data) for data in chain] for point, chain in plain.items()}


def _from_replica(data: dict) -> Edit:
    data = dict(data)
    for key in TENSOR_FIELDS:
        if key in data:
            data[key] = torch.from_numpy(data[key].copy())
    edit = edit_from_worker({**data, "heads": data.get("heads")})
    return dataclasses.replace(edit, positions=spec_from_json(data["positions"]))


@dataclasses.dataclass(frozen=True)
class CaptureReply:
    """One shard's capture: tensors keyed by address string, ``[rows, pos, ...]``, unpadded width
    for one-prompt backends, the shard's own padded width for batched ones."""

    tensors: dict[str, Packed]
    tokens: np.ndarray  # [rows, pos], PAD_ID where padded
    #: [rows, held] positions of a selection (``positions=``), -1 where a row holds fewer; None: all
    positions: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of the activations (and positions) this capture carries."""
        return sum(p.nbytes for p in self.tensors.values()) + (0 if self.positions is None else
                                                                 self.positions.nbytes)


@dataclasses.dataclass(frozen=True)
class GenerationReply:
    """One ``capture_generation`` result."""

    text: str
    token_ids: list[int]
    finish_reason: str
    tensors: dict[str, Packed]
    tokens: np.ndarray
    positions: np.ndarray | None = None
    #: the completion's logprobs as JSON data (``Completion.scores()``), or None
    scores: dict | None = None

    @property
    def nbytes(self) -> int:
        return CaptureReply(self.tensors, self.tokens, self.positions).nbytes


def where(replica: int, shard: int | None, node: str = "") -> str:
    at = f"replica {replica}" + (f" on node {node[:8]}" if node else "")
    return f"[{at}, shard {shard}]" if shard is not None else f"[{at}]"


def relabel(err: BaseException, prefix: str) -> BaseException:
    """The same kind of error with ``prefix`` in front of its message, so ``except InputError``
    still catches it on the driver and the message says where it came from."""
    message = f"{prefix} {err}"
    try:
        new = type(err)(message)
    except Exception:
        new = RemoteError(f"{prefix} {type(err).__name__}: {err}")
    new.__cause__ = err
    return new
