"""The cluster-backed model: the same calls as a local model, served by N replicas on Ray.

``load_model(name, backend=..., replicas=N)`` lands here. It joins the Ray cluster the user
connected to (``ray.init(address=...)`` or ``RAY_ADDRESS``) or starts a local one (token
auth on, every socket on 127.0.0.1, no dashboard: :mod:`.loopback`), checks that the cluster can hold N replicas *before* placing any (no silent hang),
places them in one placement group spread over the nodes (each replica's GPUs —
``tensor_parallel_size`` of them — on one node), and starts a coordinator actor that shards
calls over them. :class:`ClusterModel` is a :class:`CaptureModel`: ``run_with_cache``,
``capture_generation`` and ``await model.capture(...)`` return what the local model returns,
and a batch given to a vLLM-backed cluster is split per prompt and joined back padded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

from ..cache import Cache
from ..errors import ClusterError, InputError, ShardFailed, user_error
from ..scalars import integer
from ..dtypes import dtype_name
from ..features.transfer import put_dictionaries
from ..wire import edits_for_replica, unpack_dict
from ..capabilities import backend_class
from ..model import CaptureModel, Completion
from ..request import Request
from .placement import check_capacity as check_capacity
from .placement import connect as connect
from .placement import here, place, release
from ..tokens import Tokenizer
from ..unembedding import FetchedUnembedding, UnembedWeights


def load_cluster_model(name_or_path: str, *, backend: str = "eager", replicas: int = 1, requires_grad: bool = False,
                       dtype="float32", device: str | None = None, gpus_per_replica: float | None = None,
                       cpus_per_replica: float = 1, torch_threads: int | None = None, startup_timeout: float = 60,
                       max_in_flight_per_replica: int = 2, env_vars: dict[str, str] | None = None,
                       max_restarts: int = 3, **backend_options) -> "ClusterModel":
    """Start ``replicas`` replicas of the model on the connected (or a new local) Ray cluster.

    Placement: ``gpus_per_replica`` (default ``tensor_parallel_size`` on a cluster with GPUs, else
    0) and ``cpus_per_replica`` reserve each replica's share; ``torch_threads`` pins its torch
    threads; ``env_vars`` are set in the replicas' processes (e.g. ``VLLM_CPU_KVCACHE_SPACE``).
    ``max_restarts``: how often Ray restarts a replica whose process died (in its placement
    bundle, on another node if its node is gone); a restarted replica gets work again.
    Other keyword arguments go to the backend, as in a local ``load_model``.
    """
    if integer(replicas) is None or integer(replicas) < 1:
        raise InputError(f"replicas must be a positive int (the number of model copies), got {replicas!r}; "
                         f"use replicas=1 for one copy, or leave it out to load the model in this process")
    if integer(max_restarts) is None or integer(max_restarts) < -1:
        raise InputError(f"max_restarts must be an int >= 0 (or -1: without limit), got {max_restarts!r}")
    replicas, max_restarts = integer(replicas), integer(max_restarts)
    if requires_grad:
        raise InputError("requires_grad=True needs the model in this process: gradients do not cross Ray "
                         "processes. Load it without replicas=: load_model(name, backend='eager', requires_grad=True)")
    import ray

    from ..actors.coordinator import coordinator_actor
    from ..actors.replica import ReplicaSpec, replica_actor

    connect()
    tp = int(backend_options.get("tensor_parallel_size", 1))
    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    if gpus_per_replica is None:
        gpus_per_replica = tp if cluster_gpus and device in (None, "cuda") else 0
    if device is None and gpus_per_replica and backend_class(backend).capabilities.takes_device:
        device = "cuda"
    check_capacity(ray.nodes(), replicas, gpus_per_replica, cpus_per_replica)
    placement = place(replicas, gpus_per_replica, cpus_per_replica, startup_timeout)
    spec = ReplicaSpec(str(name_or_path), backend, dtype_name(dtype), device,
                       tuple(sorted(backend_options.items())), torch_threads)
    actor = replica_actor()
    extra = {"runtime_env": {"env_vars": {k: str(v) for k, v in env_vars.items()}}} if env_vars else {}
    handles = [actor.options(num_cpus=cpus_per_replica, num_gpus=gpus_per_replica, max_restarts=max_restarts,
                             scheduling_strategy=placement.strategies[i], **extra).remote(spec, i)
               for i in range(replicas)]
    try:
        facts = []
        for i, handle in enumerate(handles):
            try:
                facts.append(ray.get(handle.facts.remote()))
            except ray.exceptions.RayError as err:
                raise ClusterError(f"replica {i} failed to start {name_or_path!r} ({backend}): "
                                   f"{_cause(err)}") from None
    except BaseException:
        release(handles, None, placement)
        raise
    names = {i: f.node for i, f in enumerate(facts)}
    coordinator = coordinator_actor().options(scheduling_strategy=here()).remote(
        handles, facts[0].capabilities.batched, max_in_flight_per_replica, names)
    return ClusterModel(facts, handles, coordinator, placement)


@contextlib.contextmanager
def _user_errors():
    """A replica's exception reaches the caller as itself (its message already says which replica
    and shard), not wrapped in Ray's RayTaskError."""
    import ray

    try:
        yield
    except ray.exceptions.RayTaskError as err:
        raise user_error(err) from None


def _cause(err) -> str:
    text = str(user_error(err))
    return text.strip().splitlines()[-1] if text.strip() else type(err).__name__


def _tokenizer(files: dict[str, bytes]):
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


class ClusterModel(FetchedUnembedding, CaptureModel):
    """A :class:`CaptureModel` served by replicas on a Ray cluster (see the module docstring)."""

    batch_hint = "For a batch, run_with_cache(model, tokens, points) takes it whole and splits it over the replicas."

    def __init__(self, facts, handles, coordinator, placement):
        first = facts[0]
        self.info = first.info
        # the replicas' backend, except that the coordinator splits a batch over them
        self.capabilities = dataclasses.replace(first.capabilities, batched=True)
        #: each dictionary's plain data in the object store, by content key (put once, replicas
        #: fetch it the first time a request names it)
        self._dictionaries: dict[str, object] = {}
        self.dtype = first.model_dtype
        self.tok = Tokenizer(_tokenizer(first.tokenizer_files))
        self.replica_facts = list(facts)
        self._replicas = list(handles)
        self._coordinator = coordinator
        self._placement = placement
        self._weights: str | None = None
        self._o_proj: dict = {}

    def _repr_extras(self) -> list[str]:
        return [f"backend={self.backend!r}", f"replicas={len(self._replicas)}"]

    @property
    def replicas(self) -> int:
        return len(self._replicas)

    @property
    def nodes(self) -> list[str]:
        """The Ray node id of each replica."""
        return [f.node for f in self.replica_facts]

    def o_proj_weight(self, layer: int):
        """The attention output projection of ``layer``, fetched once from a replica."""
        if layer not in self._o_proj:
            self._o_proj[layer] = self._get(self._replicas[0].o_proj_weight.remote(layer)).tensor()
        return self._o_proj[layer]

    def _fetch_unembedding(self) -> UnembedWeights:
        """The final norm and the unembedding, fetched once from a replica (for the logit lens)."""
        return UnembedWeights.from_plain(self._get(self._replicas[0].unembed_weights.remote()))

    def bytes_returned(self) -> list[int]:
        """Per replica, the bytes of activations it has returned so far (what crossed the wire)."""
        import ray

        return ray.get([r.returned_bytes.remote() for r in self._replicas])

    def facts(self) -> dict:
        if self._weights is None:
            self._weights = self._get(self._replicas[0].weights_sha256.remote())
        return {"weights_sha256": self._weights, "model_dtype": self.replica_facts[0].model_dtype}

    # A caller that gives up (a cancelled await, Ctrl-C) cancels the request on the cluster:
    # the coordinator stops scheduling it and the replicas stop between decode steps (Ray passes
    # the cancellation on to the calls the coordinator made), so later calls do not queue behind it.
    def _get(self, ref):
        import ray

        try:
            with _user_errors():
                return ray.get(ref)
        except KeyboardInterrupt:
            ray.cancel(ref)
            raise

    async def _await(self, ref):
        import asyncio

        import ray

        try:
            with _user_errors():
                return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise

    # The positions spec travels as given (it was checked against these tokens here): each
    # replica resolves it against its own rows and keeps only those rows, so nothing else crosses.
    def _remote(self, r: Request):
        """The coordinator call for a checked request (a Ray object ref)."""
        if not r.detach:
            raise InputError("detach=False needs gradients, which do not cross Ray processes; load the model "
                             "locally: load_model(name, backend='eager', requires_grad=True)")
        points, edits = r.for_replica()
        saes = None if r.features is None else put_dictionaries(r.features, self._dictionaries)
        edits = edits_for_replica(edits)
        if r.options is None:
            return self._coordinator.run.remote(r.tokens.numpy(), points, _spec(r.positions), edits, saes)
        return self._coordinator.generate.remote(r.tokens.numpy(), points, dataclasses.asdict(r.options),
                                                 _spec(r.positions), edits, saes)

    def _result(self, reply, r: Request):
        if r.options is None:
            return Cache(unpack_dict(reply.tensors), r.tokens, None, self.name, self.backend, _held(reply))
        import torch

        completion = Completion.of(reply.text, reply.token_ids, reply.finish_reason, reply.scores)
        fed = torch.from_numpy(reply.tokens.copy())
        return completion, Cache(unpack_dict(reply.tensors), fed, None, self.name, self.backend, _held(reply))

    def _execute(self, request: Request):
        return self._result(self._get(self._remote(request)), request)

    async def _execute_async(self, request: Request):
        return self._result(await self._await(self._remote(request)), request)

    def write_shards(self, spec, source, skip):
        """Have the replicas write the dataset shards not in ``skip``; yield their stats as they land."""
        import uuid

        import ray

        build_id = uuid.uuid4().hex
        ref = self._coordinator.build.remote(build_id, spec, source, set(skip))
        seen = 0
        try:
            while True:
                ready, _ = ray.wait([ref], timeout=0.25)
                new = self._get(self._coordinator.progress.remote(build_id, seen))
                seen += len(new)
                yield from new
                if ready:
                    self._get(ref)
                    yield from self._get(self._coordinator.progress.remote(build_id, seen))
                    return
        finally:
            self._coordinator.forget_build.remote(build_id)

    def close(self) -> None:
        if self._coordinator is not None:
            release(self._replicas, self._coordinator, self._placement)
            self._coordinator = None


def _spec(positions):
    return None if positions is None else positions.spec


def _held(captured):
    import torch

    return None if captured.positions is None else torch.from_numpy(captured.positions.copy())

