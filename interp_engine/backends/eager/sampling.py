"""Choosing the next token from logits, for the eager backend's generation loop.

Greedy when ``temperature == 0`` (the default, and what the backend-parity tests use);
otherwise temperature, then top-k, then top-p (nucleus) filtering, and a draw from a
``torch.Generator`` seeded with ``seed`` when one is given.
"""

from __future__ import annotations

import torch

from interp_engine.model import Sampling


def sample_next(logits: torch.Tensor, options: Sampling, generator: torch.Generator | None = None) -> int:
    """One token id from a ``[vocab]`` logit vector."""
    logits = logits.float()
    if options.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / options.temperature
    if options.top_k:
        kth = torch.topk(logits, min(options.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        outside = probs.cumsum(-1) - probs > options.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
