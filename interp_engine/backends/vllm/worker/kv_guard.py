"""Request isolation in vLLM's KV cache: a block is zeroed before its new holder first runs.

vLLM hands a finished request's KV cache blocks to the next request as they are. That is safe
only if nothing a request reads was written by another, and vLLM's attention kernels do read
other requests' leftovers: they compute in whole tiles of a block. On the CPU backend (vLLM
0.32) the scores of the slots past a request's length are masked to ``-inf``, so their
probabilities are exactly 0, but the probabilities times values product still runs over every
slot of the tile, and a slot that the block's previous holder left at NaN or inf gives
``0 * NaN = NaN``. So one request that wrote a non-finite key or value (an edit that overflows,
a model that diverges) made every later, shorter request on that block return NaN logits,
until a longer prompt happened to overwrite the stale slots.

The guard, a pre-hook on the whole model that is always installed, zeroes each block the first
time a request is seen holding it, before that forward writes anything, unless the block already
holds tokens computed for that request: a prefix-cache hit (:mod:`..prefix`), whose keys and values
an earlier request with the same tokens wrote and this one reads. Every slot a request
reads is then one it wrote itself, a zero, or a shared prefix block, whatever earlier requests
wrote and whether or not they carried edits (an edited request's blocks are never shared:
:mod:`..prefix`). It costs one ``index_fill_`` per attention layer on the
forwards that hand out blocks (prefills, and decode steps that cross into a new block).
vLLM's private structure is reached through :mod:`..compat` only.
"""

from __future__ import annotations

import torch

from .. import compat as vllm_compat


class KvBlockGuard:
    """Zeroes a KV cache block before the first forward of each request that holds it."""

    def __init__(self, runner):
        self.runner = runner
        self.caches = vllm_compat.kv_cache_views(runner)
        #: block id -> the request it was last zeroed for
        self.holder: dict[int, str] = {}
        #: how many blocks were zeroed so far
        self.zeroed = 0

    def install(self, model: torch.nn.Module):
        return model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args) -> None:
        req_ids, _ = vllm_compat.batch_map(self.runner)
        fresh = []
        for rid in req_ids:
            for block, computed in vllm_compat.request_blocks(self.runner, rid):
                if self.holder.get(block) != rid:
                    self.holder[block] = rid
                    if not computed:  # a prefix-cache hit holds keys and values this request reads
                        fresh.append(block)
        if not fresh:
            return
        for kv in self.caches:
            kv.index_fill_(0, torch.tensor(fresh, dtype=torch.long, device=kv.device), 0)
        self.zeroed += len(fresh)
