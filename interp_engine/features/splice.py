"""What a dictionary misses, measured: splice its reconstruction in place of the activation and
see how much of the model's next-token loss survives.

Splicing is an edit of the dictionary's error term: ``{"resid_post.3.sae_error": Zero()}`` puts
``decode(features)`` where the activation was (with the error term kept, the activation is the
model's own, exactly: the identity ``x = decode(f) + (x - decode(f))``). :func:`ce_loss_recovered`
runs a prompt set three ways on any backend — as is, spliced, and with the activation zero-ablated
— and reports the mean next-token cross-entropy of each and the fraction of the ablation's damage
the reconstruction recovers, ``(ablated - spliced) / (ablated - clean)`` (1: nothing lost).
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F

from ..edits import Zero
from ..errors import InputError
from ..tokens import pad_batch
from .dictionary import Dictionary


@dataclasses.dataclass(frozen=True)
class SpliceLoss:
    """Mean next-token cross-entropy (nats per predicted token) over a prompt set."""

    clean: float
    spliced: float
    ablated: float
    tokens: int

    @property
    def recovered(self) -> float:
        """``(ablated - spliced) / (ablated - clean)``: 1 when splicing loses nothing, 0 when it is
        as bad as removing the activation."""
        return (self.ablated - self.spliced) / (self.ablated - self.clean)


def splice_edits(dictionary: Dictionary) -> dict:
    """The edit that puts ``dictionary``'s reconstruction in place of the activation it writes."""
    return {f"{dictionary.writes}.sae_error": Zero()}


def ce_loss_recovered(model, dictionary: Dictionary, prompts: list[str], *, batch_size: int = 16) -> SpliceLoss:
    """Next-token loss over ``prompts`` with the model as is, with ``dictionary``'s reconstruction
    spliced in (its error term zeroed), and with the activation it writes zeroed."""
    from ..batching import run_padded  # batching reaches the model, whose calls plan features: not at import

    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise InputError("ce_loss_recovered takes a non-empty list of prompt strings")
    rows = [model.tok.encode(p) for p in prompts]
    short = [i for i, r in enumerate(rows) if len(r) < 2]
    if short:
        raise InputError(f"prompt {short[0]} has fewer than 2 tokens: no next token to predict")
    runs = {"clean": {}, "spliced": splice_edits(dictionary), "ablated": {str(dictionary.writes): Zero()}}
    totals = dict.fromkeys(runs, 0.0)
    count = 0
    for first in range(0, len(rows), batch_size):
        tokens = pad_batch(rows[first:first + batch_size])
        mask = (tokens >= 0)[:, 1:]
        count += int(mask.sum())
        for name, edits in runs.items():
            cache = run_padded(model, tokens, ["logits"], edits=edits or None, saes=[dictionary])
            logits = cache["logits"][:, :-1].float().cpu()
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].clamp(min=0).flatten(), reduction="none")
            totals[name] += float((loss.view(mask.shape) * mask).sum())
    return SpliceLoss(*(totals[name] / count for name in runs), tokens=count)
