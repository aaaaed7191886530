"""Splitting a padded batch into rows and joining rows back into one padded batch.

A one-prompt backend (vLLM) runs each row at its true length, all rows in flight at once so
that its engine batches them; a cluster splits a batch over replicas; a dataset build cuts a
shard into batches of similar lengths (:func:`plan_batches`). All come back to the engine's
padded form: tokens right-padded with ``PAD_ID``, every activation zero at padded positions,
exactly what a batched local model returns.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .address import Address, parse_address
from .cache import Cache
from .edit_rows import row_edit
from .edits import check_edits
from .model import CaptureModel
from .tokens import PAD_ID, unpad
from .wire import CaptureReply, edits_for_rows, pack_dict


def chunk_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``min(parts, rows)`` contiguous, near-equal row chunks: how a batched
    backend's padded batch is cut over ``parts`` replicas."""
    n = min(parts, rows)
    bounds = np.linspace(0, rows, n + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def pad_positions(tensor: torch.Tensor, address: Address, width: int, held: int | None = None) -> torch.Tensor:
    """Zero-pad the position axes of ``tensor`` up to ``width`` (the query / selected axis up to
    ``held`` where a selection of positions was captured)."""
    pad: list[int] = []
    dims = address.position_axes
    for dim in reversed(range(1, tensor.dim())):
        target = held if held is not None and dim == dims[0] else width
        pad += [0, target - tensor.shape[dim]] if dim in dims else [0, 0]
    return F.pad(tensor, pad) if any(pad) else tensor


def pad_tokens(tokens: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(tokens, (0, width - tokens.shape[1]), value=PAD_ID)


def join_rows(parts: list[dict[Address, torch.Tensor]], tokens: list[torch.Tensor], width: int | None = None,
              positions: list[torch.Tensor] | None = None):
    """Concatenate per-row (or per-chunk) results along the batch, padded to one width.

    Returns ``(tensors, tokens, positions)``; ``positions`` (each part's held positions, when a
    selection was captured) are joined padded with -1, and the tensors to the widest selection."""
    width = width or max(t.shape[1] for t in tokens)
    held = None if positions is None else max(p.shape[1] for p in positions)
    joined = {a: torch.cat([pad_positions(p[a], a, width, held) for p in parts]) for a in parts[0]}
    padded = torch.cat([pad_tokens(t, width) for t in tokens])
    if positions is None:
        return joined, padded, None
    return joined, padded, torch.cat([F.pad(p, (0, held - p.shape[1]), value=-1) for p in positions])


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Cut rows of these ``lengths`` into padded batches of at most ``batch_tokens`` padded
    tokens (rows x the batch's longest row; a longer row gets a batch of its own), with little
    padding: rows are taken shortest first, so each batch holds rows of similar lengths. Each
    batch lists its rows in their original order. A pure function of its arguments, so a shard
    rebuilt (a rerun, a resume) is computed in the same batches and gives the same bits. When
    every row fits in one batch the plan is ``[[0, 1, ..., n-1]]``: the whole batch as given."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(sorted(current))
            current = []
        current.append(i)
    if current:
        batches.append(sorted(current))
    return batches


def run_padded(model: CaptureModel, tokens: torch.Tensor, addresses: list[Address], positions=None,
               edits=None, saes=None) -> Cache:
    """``model.run_with_cache`` on a padded batch; where the model takes one prompt per call,
    every row at its true length, all in flight at once (``model.run_many``: the vLLM engine
    batches them as ``LLM.generate`` does). The result is the padded batch a batched model would
    return. ``positions`` is a positions spec: each row resolves it against its own length, as a
    batched model does; so are the positions of ``edits``. ``saes``: dictionaries attached to the
    call (only passed on where given)."""
    more = {} if saes is None else {"saes": saes}
    if model.batched or tokens.shape[0] == 1 and bool((tokens >= 0).all()):
        return model.run_with_cache(tokens, addresses, positions=positions, edits=edits, **more)
    rows = unpad(tokens)
    caches = model.run_many(rows, addresses, positions=positions, edits=edits_by_row(model, tokens, edits), **more)
    held = None if positions is None else [c.positions for c in caches]
    joined, padded, held = join_rows([c.to_dict() for c in caches], rows, tokens.shape[1], held)
    return Cache(joined, padded, None, model.name, model.backend, held)


def edits_by_row(model: CaptureModel, tokens: torch.Tensor, edits) -> list:
    """``edits`` (as a caller gives them, for the padded batch ``tokens``) as each row's own edits:
    a value per row (batched patching) becomes that row's value, cut to the row's own width where
    it gives one per position of the batch; everything else is the same for every row."""
    if not edits:
        return [edits] * tokens.shape[0]
    planned = check_edits(edits, model.info, model.capabilities, tokens)
    lengths = (tokens >= 0).sum(dim=1).tolist()
    return [{str(a): [row_edit(p, row, lengths[row]) for p in chain] for a, chain in planned.items()}
            for row in range(tokens.shape[0])]


def split_rows(tokens: np.ndarray, batched: bool, parts: int) -> list[np.ndarray]:
    """A padded batch cut for ``parts`` replicas: one row (at its true length) per piece for
    one-prompt backends, contiguous chunks at the batch's own width for batched ones."""
    if not batched:
        return unpad(tokens)
    return [tokens[a:b] for a, b in chunk_bounds(tokens.shape[0], parts)]


def split_with_edits(tokens: np.ndarray, batched: bool, parts: int, edits: dict | None):
    """:func:`split_rows`'s pieces, each with the edits (their plain form) cut to its rows: an
    edit's value per row travels to the piece that holds the row (:func:`.wire.edits_for_rows`;
    a one-prompt piece runs at its row's own width)."""
    if not batched:
        return [(row, edits_for_rows(edits, i, i + 1, row.shape[1])) for i, row in enumerate(unpad(tokens))]
    return [(tokens[a:b], edits_for_rows(edits, a, b)) for a, b in chunk_bounds(tokens.shape[0], parts)]


def join_captured(parts: list[CaptureReply], tokens: np.ndarray, selected: bool) -> CaptureReply:
    """The pieces' captures (in :func:`split_rows` order) put back together as the padded batch
    ``tokens`` (``selected``: the pieces hold a positions selection)."""
    if len(parts) == 1 and parts[0].tokens.shape == tokens.shape:
        return parts[0]
    tensors = [{parse_address(k): v.tensor() for k, v in p.tensors.items()} for p in parts]
    held = [torch.from_numpy(np.array(p.positions)) for p in parts] if selected else None
    joined, padded, held = join_rows(tensors, [torch.from_numpy(np.array(p.tokens)) for p in parts],
                                     tokens.shape[1], held)
    return CaptureReply(pack_dict(joined), padded.numpy(), None if held is None else held.numpy())
