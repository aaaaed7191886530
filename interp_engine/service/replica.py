"""One replica of a deployed model: the Ray Serve deployment class.

Each Serve replica loads the model once (:class:`~interp_engine.actors.replica.ReplicaCore`, the
same code as a cluster model's replica) and answers two kinds of caller:

- Ray clients (``connect(name)``) call its methods through a Serve ``DeploymentHandle``: ``run``,
  ``generate``, ``facts`` ... with the cluster's wire format (:mod:`interp_engine.wire`);
- HTTP clients reach it through Serve's proxy: the FastAPI routes of :mod:`.http_api`, mounted
  with ``serve.ingress``.

Captures run on worker threads, several at once (``max_ongoing_requests``, the replica's capture
slots, :class:`.http_guard.Slots`): the eager backend takes one forward at a time (its own lock), a
vLLM engine batches concurrent requests itself. An HTTP request takes its slot only once its body
has arrived (:mod:`.http_guard`). Dictionaries clients sent are kept by content key within
``Limits.max_dictionary_memory_bytes`` (:class:`.held.HeldDictionaries`, least recently used
dropped first; a vLLM engine's workers drop their copy once no call in flight uses it).
A caller that goes away (a cancelled handle call, a closed HTTP connection) stops its capture at
the next checkpoint (:mod:`interp_engine.cancel`).
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import os
import threading

from ray import serve

from ..actors.replica import ReplicaCore, ReplicaSpec
from ..wire import CaptureReply, GenerationReply
from ..address import parse_address
from ..errors import AddressError, InputError, shown
from ..points import check_points
from ..wire import Packed
from ..positions import width_bound
from . import compat
from .http_guard import MAX_ONGOING, MAX_QUEUED
from .identity import check as check_identity
from .identity import identity as identity_of
from .held import HeldDictionaries
from .http_api import app
from .http_guard import Slots
from .limits import Limits, itemsize, response_bound


class _Core(ReplicaCore):
    """A replica core whose captures stop when the caller of the thread running them gives up,
    and whose dictionaries are kept within a byte bound (:attr:`held`)."""

    _local = threading.local()
    held: HeldDictionaries

    @classmethod
    def stop_check(cls) -> bool:
        stop = getattr(cls._local, "stop", None)
        return stop is not None and stop.is_set()

    def _saes(self, saes) -> list | None:
        """The dictionaries ``saes`` names (``[(key, a Dictionary, plain data or an object ref)]``),
        each rebuilt once and kept in :attr:`held` while it fits; a call keeps using those it was
        given even where newer ones pushed them out."""
        from ..features.dictionary import Dictionary
        from ..features.transfer import dictionary_from_replica

        if not saes:
            return None
        pinned = getattr(self._local, "pinned", None)  # released when the call's thread is done
        if pinned is not None:
            keys = [key for key, _ in saes]
            self.held.pin(keys)
            pinned.extend(keys)
        out = []
        for key, data in saes:
            dictionary = self.held.get(key)
            if dictionary is None:
                if not isinstance(data, (Dictionary, dict)):  # an object ref a Ray client put
                    import ray

                    data = ray.get(data)
                if not isinstance(data, Dictionary):
                    data = dictionary_from_replica(data)
                dictionary = self.held.keep(key, data)
            out.append(dictionary)
        return out

    def drop_dictionary(self, key: str) -> None:
        """A dictionary :attr:`held` dropped, and no call in flight uses: the model drops its own
        copy too (a vLLM engine's workers keep one on the device)."""
        drop = getattr(self.model, "drop_dictionary", None)
        if drop is not None:
            drop(key)


@serve.ingress(app)
class CaptureReplica:
    def __init__(self, spec: ReplicaSpec, token_sha256: str, limits: Limits, service: dict):
        import ray

        compat.bind_node_address()  # before Serve starts this replica's gRPC server
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.core = _Core(spec, 0, ray.get_runtime_context().get_node_id())
        self.core.held = HeldDictionaries(limits.max_dictionary_memory_bytes, on_drop=self.core.drop_dictionary)
        self.token_sha256 = token_sha256
        self.limits = limits
        self.service = dict(service)
        # app.py gives Serve room for max_uploads bodies being received besides the requests that run
        self.slots = Slots(service.get("max_ongoing_requests", MAX_ONGOING),
                           service.get("max_queued_requests", MAX_QUEUED))

    @property
    def model(self):
        return self.core.model

    async def _in_thread(self, fn, *args):
        """``fn(*args)`` on a worker thread; cancelling the awaiting task stops it at its next checkpoint."""
        stop = threading.Event()

        def watched():
            _Core._local.stop = stop
            _Core._local.pinned = pinned = []  # the dictionaries this call uses (:meth:`_Core._saes`)
            try:
                return fn(*args)
            finally:
                _Core._local.stop = _Core._local.pinned = None
                if pinned:
                    self.core.held.unpin(pinned)

        try:
            return await asyncio.to_thread(watched)
        except asyncio.CancelledError:
            stop.set()
            raise

    # -- what Ray clients call (through a DeploymentHandle) -------------------------------------
    async def identity(self) -> dict:
        """This deployment's identity (:mod:`.identity`); the weights hashed once."""
        if "_identity" not in self.__dict__:
            try:
                weights = await self._in_thread(self.core.weights_sha256)
            except NotImplementedError:  # a model without a local folder to hash
                weights = None
            self._identity = identity_of(self.service, self.model.dtype, weights)
        return self._identity

    async def checked(self, expected: dict, method: str, *args):
        """``method(*args)`` if the caller connected to this deployment (``expected``, its
        identity); ``ServiceChanged`` naming what differs otherwise."""
        check_identity(expected, await self.identity(), self.service.get("name", "?"))
        if method.startswith("_"):
            raise InputError(f"a service replica has no call {method!r}")
        answer = getattr(self, method)(*args)
        return await answer if inspect.isawaitable(answer) else answer

    async def facts(self):
        return await self._in_thread(self.core.facts)

    async def describe(self) -> dict:
        """The service's own facts (name, url, model, backend, limits), this replica's id, pid and
        Ray node, and the dictionaries it holds (``dictionaries``: count, bytes, bound, dropped)."""
        return {**self.service, "replica": self.replica_id, "pid": os.getpid(), "node": self.core.node,
                "dictionaries": self.core.held.stats()}

    def record_routing_stats(self) -> dict:
        """What :func:`.compat.replica_stats` reads for the status: the dictionaries held here."""
        return {"dictionaries": self.core.held.stats()}

    async def run(self, tokens, points, positions=None, edits=None, saes=None) -> CaptureReply:
        async with self.slots.take(bounded=False):
            return await self._run_now(tokens, points, positions, edits, saes)

    async def generate(self, tokens, points, options: dict, positions=None, edits=None,
                       saes=None) -> GenerationReply:
        async with self.slots.take(bounded=False):
            return await self._generate_now(tokens, points, options, positions, edits, saes)

    async def _run_now(self, tokens, points, positions=None, edits=None, saes=None) -> CaptureReply:
        """:meth:`run` in a slot taken already (an HTTP request's, :mod:`.http_guard`; private, so a
        Ray client's :meth:`checked` call cannot skip the slot)."""
        return await self._in_thread(self.core.run, tokens, points, positions, edits, saes)

    async def _generate_now(self, tokens, points, options: dict, positions=None, edits=None,
                           saes=None) -> GenerationReply:
        return await self._in_thread(self.core.generate, tokens, points, options, positions, edits, saes)

    def held_dictionaries(self, keys: list[str]) -> dict:
        """``{key: Dictionary}`` of those of ``keys`` this replica holds (an HTTP client sends the others)."""
        return {key: d for key in keys if (d := self.core.held.get(key)) is not None}

    def check_dictionary_memory(self, saes: list) -> None:
        """Refuse (413) a call whose dictionaries together could never be held here."""
        from .held import dictionary_bytes

        size = sum(dictionary_bytes(d) for d in {key: d for key, d in saes}.values())
        if size > self.limits.max_dictionary_memory_bytes:
            raise self.limits.refuse("max_dictionary_memory_bytes", f"dictionaries of {size} bytes",
                                     "attach fewer or smaller dictionaries per request")

    async def write_shard(self, spec, index: int, texts: list[str]):
        async with self.slots.take(bounded=False):
            return await self._in_thread(self.core.write_shard, spec, index, texts)

    async def o_proj_weight(self, layer: int) -> Packed:
        n_layers = self.model.info.n_layers
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < n_layers:
            raise AddressError(f"layer {shown(layer)} is out of range: this model has layers 0..{n_layers - 1}")
        return await self._in_thread(self.core.o_proj_weight, layer)

    async def unembed_weights(self) -> dict:
        return await self._in_thread(self.core.unembed_weights)

    async def weights_sha256(self) -> str:
        return await self._in_thread(self.core.weights_sha256)

    async def ping(self) -> int:
        return os.getpid()

    # -- what the HTTP routes call --------------------------------------------------------------
    def checked_points(self, points: list[str]) -> list[str]:
        """The addresses ``points`` names (site names expand to every layer), checked against the model."""
        return [str(a) for a in check_points(points, self.model.info, self.model.capabilities)]

    def check_limits(self, tokens, points: list[str], positions=None, new_tokens: int = 0,
                     widths: dict[str, int] | None = None) -> None:
        """Refuse (HTTP 413) a request over a limit, its response size bounded from the model's shapes
        (a feature point's from ``widths``, its dictionary's feature count by site)."""
        rows, width = tokens.shape
        self.limits.check_request(rows, width, len(points), new_tokens)
        total = width + new_tokens
        held = total if positions is None else min(total, width_bound(positions, total))
        bound = response_bound([parse_address(p) for p in points], self.model.info, rows, held, total,
                               itemsize(self.model.dtype), widths or {})
        self.limits.check_response(bound, "a response of up to")

    async def info_json(self) -> dict:
        """What ``GET /info`` answers: :meth:`facts` and :meth:`describe` as JSON."""
        import base64
        import dataclasses

        facts = await self.facts()
        return {"service": await self.describe(), "model": _plain(dataclasses.asdict(facts.info)),
                "capabilities": _plain(dataclasses.asdict(facts.capabilities)), "dtype": facts.model_dtype,
                "tokenizer_files": {k: base64.b64encode(v).decode() for k, v in facts.tokenizer_files.items()}}


def _plain(data: dict) -> dict:
    """Sets and tuples as sorted / ordered lists (JSON has neither)."""
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else list(v) if isinstance(v, tuple) else v
            for k, v in data.items()}
