"""The methods the vLLM backend calls on every worker, by name.

vLLM mixes a ``worker_extension_cls`` into its worker class, and ``collective_rpc("name")``
runs that method on every worker (in this process for one rank, in each worker process under
tensor parallelism). Only method names and plain data (dicts, lists, strings, tensors) cross
the process boundary, so no callable is ever pickled and vLLM's insecure-serialization switch
stays off. All names start with ``interp_`` so they cannot clash with the worker's own.

vLLM's private structure (the worker's model runner, attention geometry, repacked weights) is
reached through :mod:`..compat` only.
"""

from __future__ import annotations

import torch

from .. import compat as vllm_compat
from .hooks import WorkerRecorder
from .kv_guard import KvBlockGuard
from interp_engine.errors import InternalError
from interp_engine.wire import WorkerRequest


class CaptureExtension:
    """Mixed into the vLLM worker: a :class:`WorkerRecorder` per worker, and weight reads."""

    def _interp_recorder(self) -> WorkerRecorder:
        recorder = getattr(self, "_interp_state", None)
        if recorder is None:
            rank, size = vllm_compat.tensor_parallel()
            recorder = WorkerRecorder(vllm_compat.worker_runner(self), tp_rank=rank, tp_size=size)
            self._interp_state = recorder
        return recorder

    def interp_guard_kv(self) -> None:
        """Install the KV cache block guard (:mod:`.kv_guard`) once, for every request
        this worker will run, captured or not."""
        if getattr(self, "_interp_kv_guard", None) is None:
            runner = vllm_compat.worker_runner(self)
            guard = KvBlockGuard(runner)
            guard.install(vllm_compat.runner_model(runner))
            self._interp_kv_guard = guard

    def interp_depth_limit(self) -> int:
        """How many layers this worker's model runs; 0 if it cannot be told to run fewer
        (:func:`.vllm_compat.layer_range`)."""
        recorder = self._interp_recorder()
        span = vllm_compat.layer_range(recorder.stack)
        if span is None or span[0] != 0 or span[1] != len(recorder.layers):
            return 0
        self._interp_full_depth = span[1]
        return span[1]

    def interp_set_depth(self, layers: int | None) -> None:
        """Run only layers ``0 .. layers - 1`` from the next forward on (None: every layer).
        The engine loop asks for it only while every request it holds is a prefill whose
        deepest point is above ``layers`` (:mod:`..loop`); layers past it, and with them
        the logits, are garbage then and nothing reads them."""
        full = self._interp_full_depth
        vllm_compat.set_layer_end(self._interp_recorder().stack, full if layers is None else min(layers, full))

    def interp_register(self, requests: dict) -> None:
        """``{request id: WorkerRequest.to_rpc()}``, read back into typed requests here."""
        self._interp_recorder().register({rid: WorkerRequest.from_rpc(data) for rid, data in requests.items()})

    def interp_add_dictionary(self, data: dict) -> None:
        """Keep a sparse dictionary (:func:`interp_engine.features.transfer.dictionary_for_worker`'s data) on this
        worker's device under its content key, for the requests that will name it."""
        self._interp_recorder().features.add_dictionary(data)

    def interp_drop_dictionary(self, key: str) -> None:
        """Forget the dictionary kept under ``key`` (a request registered with it runs to its end)."""
        self._interp_recorder().features.drop_dictionary(key)

    def interp_take(self, request_ids: list[str]) -> dict:
        return self._interp_recorder().take(request_ids)

    def interp_release(self, request_ids: list[str]) -> None:
        self._interp_recorder().release(request_ids)

    def interp_state(self) -> dict:
        """What this worker holds: registered requests not taken yet, hooks installed now (an
        idle engine has none), the most registered requests seen in one forward, the bytes of
        every row handed back to the driver so far, and the KV cache blocks the guard zeroed
        (None: no guard), how many layers the next forward runs, and the dictionaries kept here
        (count and bytes of their tensors)."""
        recorder = self._interp_recorder()
        return {"pending": sorted(recorder.requests.wanted), "hooks": recorder.hooks_installed,
                "edited": sorted(recorder.editor.edits),
                "max_batch": recorder.requests.max_batch,
                "bytes_returned": recorder.bytes_returned + recorder.features.bytes_returned,
                "kv_blocks_zeroed": getattr(getattr(self, "_interp_kv_guard", None), "zeroed", None),
                "dictionaries": len(recorder.features.dictionaries),
                "dictionary_bytes": recorder.features.dictionary_bytes(),
                "layers_run": (vllm_compat.layer_range(recorder.stack) or (0, len(recorder.layers)))[1]}

    def interp_unreadable_sites(self) -> list[str]:
        """Sites of the table this engine never computes in a readable form (see vllm_moe)."""
        from .experts import unreadable_sites

        recorder = self._interp_recorder()
        return unreadable_sites(list(recorder.layers), recorder.table)

    def interp_geometry(self, path: str) -> dict:
        """Heads and head size as this rank's attention kernels run them (``path``: the kernel
        module inside a layer, from the family record)."""
        return vllm_compat.attention_geometry(self._interp_recorder().layers[0].get_submodule(path))

    def interp_o_proj_weight(self, layer: int, path: str) -> torch.Tensor:
        """This rank's block of layer ``layer``'s attention output projection weight
        ``[d_model, heads_on_this_rank * d_head]`` (``path`` is relative to the layer)."""
        return vllm_compat.linear_weight(self._interp_recorder().layers[layer].get_submodule(path))

    def interp_unembedding(self, norm_path: str, head_paths: list[str]) -> dict:
        """The final norm's state dict and this rank's vocabulary shard of the unembedding
        ``[vocab_on_this_rank (padded), d_model]`` (paths relative to the model; the first of
        ``head_paths`` that exists: a model with tied embeddings may have no ``lm_head`` and
        unembed with its input embedding)."""
        model = self._interp_recorder().model
        norm = {k: v.detach().to("cpu", copy=True) for k, v in model.get_submodule(norm_path).state_dict().items()}
        head = None
        for path in head_paths:
            try:
                head = model.get_submodule(path)
                break
            except AttributeError:
                continue
        if head is None:
            raise InternalError(f"[Internal] this vLLM model has none of {head_paths} to unembed with")
        return {"norm": norm, "weight": vllm_compat.embedding_weight(head)}
