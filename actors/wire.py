"""What crosses the wire between the driver, the coordinator and the replicas.

Only plain data travels: numpy arrays (zero-copy out of Ray's object store), strings, ints and
small frozen dataclasses. Model objects never do. A tensor whose dtype numpy lacks (bfloat16)
travels as its raw 16-bit pattern and is viewed back on arrival, so nothing is rounded.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from interp_engine.address import Address, format_address, parse_address
from interp_engine.dtypes import Packed
from interp_engine.errors import RemoteError


def pack_dict(data: dict[Address, torch.Tensor]) -> dict[str, Packed]:
    return {format_address(a): Packed.of(t) for a, t in data.items()}


def unpack_dict(data: dict[str, Packed]) -> dict[Address, torch.Tensor]:
    return {parse_address(k): v.tensor() for k, v in data.items()}


@dataclasses.dataclass(frozen=True)
class Captured:
    """One shard's capture: tensors keyed by address string, ``[rows, pos, ...]``, unpadded width
    for one-prompt backends, the shard's own padded width for batched ones."""

    tensors: dict[str, Packed]
    tokens: np.ndarray  # [rows, pos], PAD_ID where padded
    #: [rows, held] positions of a selection (``positions=``), -1 where a row holds fewer; None: all
    positions: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of the activations (and positions) this capture carries."""
        return sum(p.array.nbytes for p in self.tensors.values()) + (0 if self.positions is None else
                                                                       self.positions.nbytes)


@dataclasses.dataclass(frozen=True)
class Generated:
    """One ``capture_generation`` result."""

    text: str
    token_ids: list[int]
    finish_reason: str
    tensors: dict[str, Packed]
    tokens: np.ndarray
    positions: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return Captured(self.tensors, self.tokens, self.positions).nbytes


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
