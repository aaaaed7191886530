"""A replica: one copy of the model, serving capture calls for the coordinator.

:class:`ReplicaCore` is a plain class (tested without Ray): it loads the model from a
:class:`ReplicaSpec` with :func:`interp_engine.load_model`, and answers with plain data (numpy
arrays, see :mod:`.wire`). :data:`ReplicaActor` is the Ray shell around it; the cluster model
places one per replica, with the GPUs it needs (``tensor_parallel_size`` of them for vLLM,
together on one node).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch

from interp_engine import cancel
from interp_engine.batching import run_padded
from interp_engine.dataset.shard import ShardSpec, ShardStats
from interp_engine.dataset.writer import MAX_WRITERS, ShardWriter
from interp_engine.features.dictionary import Dictionary
from interp_engine.model import CaptureModel
from interp_engine.request import Points

from interp_engine.features.transfer import dictionary_from_replica
from interp_engine.wire import (CaptureReply, GenerationReply, Packed, edits_from_replica,
                                pack_dict)


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """How to load the model on a replica: the arguments of a local ``load_model`` call."""

    name_or_path: str
    backend: str = "eager"
    dtype: str = "float32"
    device: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    torch_threads: int | None = None

    def load(self) -> CaptureModel:
        from interp_engine.local import load_local

        return load_local(self.name_or_path, self.backend, dtype=self.dtype, device=self.device, **dict(self.options))


@dataclasses.dataclass(frozen=True)
class ReplicaFacts:
    """What the driver needs to know about the model a replica serves."""

    info: Any  # ModelInfo
    capabilities: Any  # Capabilities of the loaded model
    model_dtype: str
    node: str
    pid: int
    tokenizer_files: dict[str, bytes]


class ReplicaCore:
    #: the stop check its capture calls run under (see :mod:`interp_engine.cancel`); the Ray
    #: actor reads Ray's cancellation flag of the running call, a plain core never stops
    stop_check = None

    def __init__(self, spec: ReplicaSpec, index: int = 0, node: str = ""):
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.index = index
        self.node = node
        self.model = spec.load()
        #: bytes of the activations this replica has returned (what crosses to the coordinator)
        self.bytes_returned = 0
        #: dataset shards are written on threads beside the capture of the next
        #: (:mod:`interp_engine.dataset.writer`); the eager backend runs one forward at a time
        #: (its own lock), a vLLM engine batches concurrent calls itself
        self.shards = ShardWriter(self.model)

    def facts(self) -> ReplicaFacts:
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            self.model.tok.hf.save_pretrained(tmp)
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
        return ReplicaFacts(self.model.info, self.model.capabilities,
                            self.model.dtype, self.node, os.getpid(), files)

    def weights_sha256(self) -> str:
        return self.model.facts()["weights_sha256"]

    def run(self, tokens: np.ndarray, points: list[str], positions=None, edits=None, saes=None) -> CaptureReply:
        """Capture a padded batch (split per prompt where the backend takes one at a time).
        ``positions`` (a positions spec) is applied by the model here, so only the selected rows
        are ever returned. ``edits``: plain data (:func:`interp_engine.wire.edits_for_replica`).
        ``saes``: the call's dictionaries as ``[(key, data or object ref)]``; their features are
        encoded here and travel back sparse."""
        batch = torch.from_numpy(np.array(tokens, dtype=np.int64))
        with cancel.watching(self.stop_check):
            cache = run_padded(self.model, batch, Points.trusted(points), positions, edits_from_replica(edits),
                               saes=self._saes(saes))
        captured = CaptureReply(pack_dict(cache.to_dict()), cache.tokens.numpy(), _held(cache))
        self.bytes_returned += captured.nbytes
        return captured

    def generate(self, tokens: np.ndarray, points: list[str], options: dict, positions=None,
                 edits=None, saes=None) -> GenerationReply:
        batch = torch.from_numpy(np.array(tokens, dtype=np.int64))
        with cancel.watching(self.stop_check):
            completion, cache = self.model.capture_generation(batch, Points.trusted(points), positions=positions,
                                                              edits=edits_from_replica(edits), saes=self._saes(saes),
                                                              **options)
        generated = GenerationReply(completion.text, list(completion.token_ids), completion.finish_reason,
                                    pack_dict(cache.to_dict()), cache.tokens.numpy(), _held(cache),
                                    completion.scores())
        self.bytes_returned += generated.nbytes
        return generated

    def _saes(self, saes) -> list | None:
        """The dictionaries ``saes`` names, ``[(key, plain data, an object ref or a Dictionary)]``,
        each fetched and rebuilt once per replica and kept by key (None: one held already)."""
        if not saes:
            return None
        held = self.__dict__.setdefault("_dictionaries", {})
        for key, data in saes:
            if key not in held:
                if isinstance(data, Dictionary):  # rebuilt (and checked) already: an HTTP upload
                    held[key] = data
                    continue
                if not isinstance(data, dict):  # an object ref the cluster model put
                    import ray

                    data = ray.get(data)
                held[key] = dictionary_from_replica(data)
        return [held[key] for key, _ in saes]

    def returned_bytes(self) -> int:
        """Bytes of activations returned so far (for the transfer tests and the benchmark)."""
        return self.bytes_returned

    def write_shard(self, spec: ShardSpec, index: int, texts: list[str]) -> ShardStats:
        """Capture and publish one shard. The Ray actor runs up to ``MAX_WRITERS + 1`` of these
        at once (the coordinator sends ``spec.writers + 1``): one captures while the others write."""
        return dataclasses.replace(self.shards.write(spec, index, texts), replica=self.index, pid=os.getpid())

    def o_proj_weight(self, layer: int):
        return Packed.of(self.model.o_proj_weight(layer))

    def unembed_weights(self) -> dict:
        """The final norm's and the unembedding's weights, as plain data (for the logit lens)."""
        return self.model.unembed_weights().as_plain()

    def ping(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.model.close()


def _held(cache) -> np.ndarray | None:
    return cache.positions.numpy() if cache.selected else None


def ray_task_cancelled() -> bool:
    """Whether ``ray.cancel`` was called on the Ray task running this code (a sync or threaded
    actor's call keeps running after ``ray.cancel``: it has to look at this flag itself)."""
    import ray

    return ray.get_runtime_context().is_canceled()


def replica_actor():
    """The Ray actor class around :class:`ReplicaCore` (made on first use: importing this module
    never touches Ray)."""
    import ray

    # Declaring a concurrency group (even one no method uses) makes Ray queue the calls in its own
    # scheduler instead of the worker's ordered queue (calls still run one at a time); there
    # ``ray.cancel`` drops calls that have not started. Seen on Ray 2.60: without it, calls
    # queued behind a running one ran after ``ray.cancel`` all the same.
    # Dataset shards run in their own group, several at once: one is captured while the others
    # are encoded and written (ReplicaCore.write_shard); every other call runs one at a time.
    @ray.remote(concurrency_groups={"control": 1, "shards": MAX_WRITERS + 1})
    class ReplicaActor(ReplicaCore):
        def __init__(self, spec: ReplicaSpec, index: int):
            super().__init__(spec, index, ray.get_runtime_context().get_node_id())
            self.stop_check = ray_task_cancelled

        @ray.method(concurrency_group="shards")
        def write_shard(self, spec: ShardSpec, index: int, texts: list[str]) -> ShardStats:
            return super().write_shard(spec, index, texts)

    return ReplicaActor
