"""``connect(...)``: a deployed service as a :class:`~interp_engine.model.CaptureModel`.

``connect("smollm2")`` (any process connected to the cluster) talks to the deployment through
Ray; ``connect("http://127.0.0.1:8000/smollm2", token=...)`` (any process that can reach the URL;
no Ray needed) over HTTP. Either way no weights are loaded here: the model learns the deployed
model's shape, capabilities and tokenizer once, checks every call here with the same code as a
local model (so bad input fails before it is sent, with the same errors), and sends the checked
request. A padded batch is cut as a cluster model cuts it (a row per prompt for one-prompt
backends, one chunk per replica for batched ones), the pieces run concurrently on whichever
replicas Serve picks, and the results are joined back in order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import re
import tempfile
from pathlib import Path

import numpy as np

from ..batching import join_captured, split_with_edits
from ..wire import unpack_dict
from ..cache import Cache
from ..wire import edits_for_replica, edits_for_rows
from . import fit
from ..errors import InputError, shown
from ..model import CaptureModel, Completion
from ..request import Request
from ..tokens import Tokenizer
from ..unembedding import FetchedUnembedding


class ServiceModel(FetchedUnembedding, CaptureModel):
    """A :class:`CaptureModel` whose replicas are a deployed service (see the module docstring)."""

    batch_hint = "For a batch, run_with_cache(model, tokens, points) takes it whole and splits it over the replicas."

    def __init__(self, transport):
        self.transport = transport
        facts = transport.facts()
        self.info = facts.info
        self.capabilities = dataclasses.replace(facts.capabilities, batched=True)
        self._replica_batched = facts.capabilities.batched
        self.dtype = facts.dtype
        self.service = facts.service
        #: what one request may carry (:mod:`.fit`); None where the transport has no per-request limits (Ray)
        self.limits = fit.published(self.service) if transport.limited else None
        self._tokenizer_files = _checked_files(facts.tokenizer_files)
        self._o_proj: dict = {}
        self._weights: str | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @functools.cached_property
    def tok(self) -> Tokenizer:
        """The service's tokenizer, built on first use (``to_tokens``, ``to_str_tokens``, ...): importing
        the tokenizer library is most of a connect's time, and a client that sends token ids never needs it."""
        return Tokenizer(_tokenizer(self._tokenizer_files))

    def __repr__(self) -> str:
        return f"ServiceModel({self.service['name']!r} over {self.transport.kind}, backend={self.backend!r})"

    @property
    def url(self) -> str:
        return self.service["url"]

    def status(self) -> dict:
        """The service's replicas by state, its health, and each replica's queue (see :mod:`.status`)."""
        return self.transport.status()

    def o_proj_weight(self, layer: int):
        if layer not in self._o_proj:
            self._o_proj[layer] = self.transport.o_proj_weight(layer)
        return self._o_proj[layer]

    def _fetch_unembedding(self):
        return self.transport.unembed_weights()

    def facts(self) -> dict:
        if self._weights is None:
            self._weights = self.transport.weights_sha256()
        return {"weights_sha256": self._weights, "model_dtype": self.dtype}

    # -- the calls ------------------------------------------------------------------------------
    def _pieces(self, tokens, points, spec, edits, saes) -> list[tuple[np.ndarray, dict | None]]:
        """The rows each call carries, with the edits cut to them (a value per row goes with its
        row): a piece per replica, or more where the service's limits allow fewer rows a request."""
        tokens = tokens.numpy()
        parts = int(self.service.get("replicas", 1))
        if self.limits is not None and self._replica_batched:
            most = fit.rows_per_request(self.limits, self.info, self.dtype, tokens.shape[1], points, spec,
                                        self._widths(saes), lambda k: self._body_bytes(tokens, k, points, spec,
                                                                                        edits, saes))
            parts = max(parts, -(-tokens.shape[0] // most))
        elif self.limits is not None:  # a row per request: each at its own width
            for row in set(int(n) for n in (tokens >= 0).sum(axis=1)):
                fit.rows_per_request(self.limits, self.info, self.dtype, max(row, 1), points, spec, self._widths(saes))
        return split_with_edits(tokens, self._replica_batched, parts, edits)

    def _body_bytes(self, tokens, rows: int, points, spec, edits, saes) -> int:
        return fit.body_size(self.transport._body(tokens[:rows], points, spec, edits_for_rows(edits, 0, rows), saes))

    @staticmethod
    def _widths(saes) -> dict[str, int]:
        return {str(d.reads): d.d_sae for _, d in saes or ()}

    def _map(self, fn, pieces: list) -> list:
        if len(pieces) == 1:
            return [fn(pieces[0])]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="interp-service")
        return list(self._pool.map(fn, pieces))

    def _parts(self, r: Request):
        """What every piece of the request carries: its points as strings, positions spec, edits as
        data and dictionaries by key. Feature points and edits travel as points and edits, as to a
        cluster replica; the replica encodes the features and sends back only the active ones."""
        if not r.detach:
            raise InputError("detach=False needs gradients, which do not cross processes; load the model "
                             "locally: load_model(name, backend='eager', requires_grad=True)")
        points, edits = r.for_replica()
        saes = None if r.features is None else self.transport.dictionaries(r.features)
        return points, _spec(r.positions), edits_for_replica(edits), saes

    def _execute(self, request: Request):
        points, spec, edits, saes = self._parts(request)
        if request.options is not None:
            return self._completion(self.transport.generate(request.tokens.numpy(), points,
                                                            dataclasses.asdict(request.options), spec, edits, saes))
        pieces = self._pieces(request.tokens, points, spec, edits, saes)
        parts = self._map(lambda piece: self.transport.run(piece[0], points, spec, piece[1], saes), pieces)
        return self._cache(join_captured(parts, request.tokens.numpy(), request.positions is not None), request.tokens)

    async def _execute_async(self, request: Request):
        points, spec, edits, saes = self._parts(request)
        if request.options is not None:
            return self._completion(await self.transport.agenerate(
                request.tokens.numpy(), points, dataclasses.asdict(request.options), spec, edits, saes))
        return self._cache(await self.transport.arun(request.tokens.numpy(), points, spec, edits, saes),
                           request.tokens)

    def _cache(self, reply, tokens) -> Cache:
        return Cache(unpack_dict(reply.tensors), tokens, None, self.name, self.backend, _held(reply))

    def _completion(self, reply):
        import torch

        completion = Completion.of(reply.text, reply.token_ids, reply.finish_reason, reply.scores)
        return completion, self._cache(reply, torch.from_numpy(np.array(reply.tokens, dtype=np.int64)))

    def close(self) -> None:
        """Drop this connection (the service keeps running; ``shutdown(name)`` ends it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class RayServiceModel(ServiceModel):
    """A service reached through Ray; ``build_dataset`` has its replicas write the shards."""

    def write_shards(self, spec, source, skip):
        """Write the dataset shards not in ``skip`` on the service's replicas; yield their stats as they land."""
        shards = source.shards(spec.shard_size, set(skip), spec.order())
        in_flight = 2 * int(self.service.get("replicas", 1))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="interp-service")
        pending: set = set()
        for index, texts in shards:
            pending.add(self._pool.submit(self.transport.call, "write_shard", spec, index, texts))
            if len(pending) >= in_flight:
                done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                yield from (f.result() for f in done)
        while pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            yield from (f.result() for f in done)


def connect(target: str, *, token: str | None = None, timeout: float = 600.0) -> ServiceModel:
    """The service ``target`` as a model: a service name (through the connected Ray cluster, or
    ``RAY_ADDRESS``) or its URL ``http://host:port/NAME`` (over HTTP, with the bearer ``token``;
    without one, the token file ``serve()`` wrote on this machine for NAME is read, and sent only if
    it was written for this very URL). ``timeout`` bounds the whole connect and each later wait
    for a reply."""
    if not isinstance(target, str) or not target:
        raise InputError(f"connect() takes a service name ('smollm2') or its URL ('http://127.0.0.1:8000/smollm2'), "
                         f"got {target!r}")
    if target.startswith(("http://", "https://")):
        from .auth import read_token
        from .transport import HttpTransport

        transport = HttpTransport(target, token or read_token(target), timeout)
        return ServiceModel(transport)
    from ray import serve

    from ..errors import ServiceError
    from .ray_transport import RayTransport

    _join_cluster()
    running = serve.status().applications
    if target not in running:
        raise ServiceError(f"no service {target!r} on this cluster; running: {', '.join(sorted(running)) or 'none'}. "
                           f"Deploy it with serve(model, name={target!r}) or interp-engine serve")
    return RayServiceModel(RayTransport(target, timeout=timeout))


def _join_cluster() -> None:
    """Join the Ray cluster this process connected to, or ``RAY_ADDRESS``; never start a new one
    (it would hold no services)."""
    import os

    import ray

    from ..errors import ServiceError

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise ServiceError("a service is reached by name through the Ray cluster it runs on, and this process is "
                           "connected to none: call ray.init(address=...) first or set RAY_ADDRESS (python "
                           "cluster/local_cluster.py env prints it for a local cluster), or connect over HTTP with "
                           "connect(url, token=...)")
    ray.init(address=address, log_to_driver=False)


#: what a tokenizer file the service sends may be called: a plain file name, never a path
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_+-]*(\.[A-Za-z0-9_+-]+)*")
#: at most this many tokenizer files, of at most this many bytes together
MAX_TOKENIZER_FILES = 32
MAX_TOKENIZER_BYTES = 256 * 2**20


def _checked_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The service's tokenizer files, refused unless they are few, small and named by plain file
    names (checked at connect, before anything is written; the tokenizer is built on first use)."""
    from ..errors import UnsafeServiceAnswer

    if not isinstance(files, dict) or not 0 < len(files) <= MAX_TOKENIZER_FILES:
        raise UnsafeServiceAnswer(f"the service sent {len(files) if isinstance(files, dict) else type(files).__name__}"
                                  f" tokenizer files (a tokenizer has 1 to {MAX_TOKENIZER_FILES}): refused")
    for name, data in files.items():
        if not isinstance(name, str) or len(name) > 128 or not _FILE_NAME.fullmatch(name):
            raise UnsafeServiceAnswer(f"the service named a tokenizer file {shown(name)}, which is not a plain file "
                                      f"name (letters, digits, '_', '+', '-', dots between them; no folders): "
                                      f"the connection is refused and nothing was written. Check that the URL is "
                                      f"your service")
        if not isinstance(data, bytes):
            raise UnsafeServiceAnswer(f"the service sent tokenizer file {name!r} as {type(data).__name__}: refused")
    if sum(len(data) for data in files.values()) > MAX_TOKENIZER_BYTES:
        raise UnsafeServiceAnswer(f"the service sent over {MAX_TOKENIZER_BYTES} bytes of tokenizer files: refused")
    return files


def _tokenizer(files: dict[str, bytes]):
    """The tokenizer of the service's files, written to a temporary folder of this client's own
    under names that are checked to be plain file names: a peer never chooses a path here."""
    from transformers import AutoTokenizer

    from ..errors import UnsafeServiceAnswer

    _checked_files(files)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp).resolve()
        for name, data in files.items():
            path = folder / name
            if path.parent != folder:  # the name check makes this impossible; never trust one check alone
                raise UnsafeServiceAnswer(f"tokenizer file {name!r} would land outside {folder}: refused")
            with open(path, "xb") as out:
                out.write(data)
        return AutoTokenizer.from_pretrained(str(folder))


def _points(addresses) -> list[str]:
    return [str(a) for a in addresses]


def _spec(positions):
    return None if positions is None else positions.spec


def _held(captured):
    import torch

    return None if captured.positions is None else torch.from_numpy(np.array(captured.positions, dtype=np.int64))
