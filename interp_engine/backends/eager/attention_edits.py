"""Edits of what attention takes and forms on the eager backend: q / k / v and the pattern.

The eager :class:`~.recorder.Recorder` hands one :class:`AttentionEditor` per attention module
to :func:`.attention.editing`, which calls it between the projections and the scores.
"""

from __future__ import annotations

import torch

from interp_engine.edits import edit_chain


class AttentionEditor:
    """Edits of q / k / v (``[b, heads, pos, d_head]`` as attention takes them) and of the
    pattern of one attention module. The cache update runs before attention, so the keys and
    values given here are the KV cache's own tensors, holding every past position: this step's
    are edited in place, so later steps attend to the edited ones (earlier steps were edited when
    they were computed)."""

    def __init__(self, recorder, addresses: list[Address]):
        self.recorder = recorder
        self.planned = {a.name: recorder.edits[a] for a in addresses}

    def _edit(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return edit_chain(self.planned[name], tensor.transpose(1, 2), self.recorder.start).transpose(1, 2)

    def inputs(self, query, key, value):
        q_len = query.shape[2]
        if "q" in self.planned:
            query = self._edit("q", query)
        out = {"k": key, "v": value}
        for name in ("k", "v"):
            if name not in self.planned:
                continue
            tensor = out[name]
            step = self._edit(name, tensor[:, :, -q_len:])
            if torch.is_grad_enabled():  # no KV cache is kept with gradients (run_with_cache)
                out[name] = step if tensor.shape[2] == q_len else torch.cat([tensor[:, :, :-q_len], step], dim=2)
            else:
                tensor[:, :, -q_len:] = step  # the KV cache's own tensor: later steps see the edit
        return query, out["k"], out["v"]

    def weights(self, weights):
        if "pattern" not in self.planned:
            return None
        return self._edit("pattern", weights)
