"""The vLLM backend: the same address space, read from a running vLLM engine.

``load_model(name, backend="vllm")`` starts a vLLM engine (see :mod:`.engine` for the
options it fixes and why) and a thread that drives it (:mod:`.loop`). Each call is one
engine request for one prompt at its true length, so a ``[2, pos]`` batch is refused:
``await model.capture(...)`` many prompts at once instead, and they share the engine's
continuous batching. Workers record each request's rows at its points
(:mod:`.worker.hooks`); this module puts the ranks' pieces together into ``[1, pos, ...]``
tensors with the same shapes as the eager backend's.

Served: ``resid_pre/mid/post``, ``attn_out`` / ``mlp_out`` (the blocks' raw outputs) and ``attn_out_post``
/ ``mlp_out_post`` (what they add to the residual), ``z``, ``q``/``k``/``v`` (as the
attention kernel takes them: after qk-norm and rotary), ``mlp_post``, ``logits``, and
``resid_streams.L.0`` (the single stream, equal to ``resid_post.L``); on MoE families
``router_logits`` and, where the router's selection is read from the call that hands it to the
expert kernel, ``expert_weights`` / ``expert_indices`` (:mod:`.worker.experts`, docs/MOE.md). ``pattern`` is never formed
by vLLM's fused attention, and vLLM builds no autograd graph: both are clear errors.

A prefill-only capture (``run_with_cache``, ``model.capture`` without ``max_tokens``) runs only
the layers up to its deepest point while every request in the engine is such a prefill (see
:mod:`.loop`; families whose vLLM model class loops over ``start_layer .. end_layer``);
generation and the logits always run the whole model. ``run_many`` submits many prompts at
once, as a dataset build does.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

import torch

from interp_engine import cancel
from interp_engine.address import Address, FeatureAddress
from interp_engine.archs import SAME_AS, arch_for, has_record, model_info, unserved_sites, vllm_reads, vllm_sites
from interp_engine.cache import Cache
from interp_engine.capabilities import Capabilities
from interp_engine.edit_directions import DIRECTIONAL
from interp_engine.model import CaptureModel, Completion
from interp_engine.positions import Selection, held_positions
from interp_engine.request import Request
from interp_engine.tokens import Tokenizer, fed_tokens
from interp_engine.errors import InputError, InternalError, UnsupportedModel
from interp_engine.unembedding import FetchedUnembedding, UnembedWeights
from interp_engine.features.transfer import dictionary_for_worker, features_for_worker
from interp_engine.wire import WorkerRequest, edit_for_worker
from interp_engine.features.sparse import SparseRows
from ..heads import split_heads
from .engine import engine_options, memory_defaults, quiet_start, start_engine, stop_engine
from .loop import EngineLoop, Finished, Job, run_on_loop
from .limits import check_limits
from .prefix import OwnBlocks, first_needed
from .sampling import sampling_params, scores



class VllmModel(FetchedUnembedding, CaptureModel):
    capabilities = Capabilities(
        "vllm", "vLLM", batched=False, forms_pattern=False, gradients=False,
        writable=frozenset({"resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post", "resid_post",
                            "z", "mlp_post", "q", "k",
                            "v"}),
        function_edits=False, takes_device=False, features=True)
    batch_hint = "A cluster model (load_model(..., replicas=N)) splits a batch for you."

    def __init__(self, llm, hf_config, hf_tokenizer, name: str, *, max_model_len: int, tensor_parallel_size: int,
                 dtype: torch.dtype = torch.float32):
        self.llm = llm
        self.dtype = str(dtype).removeprefix("torch.")
        self.hf_config = hf_config
        self.arch = arch_for(hf_config)
        self.sites = vllm_sites(self.arch.family)
        self.info = model_info(hf_config, name)
        self.tok = Tokenizer(hf_tokenizer)
        self.max_model_len = max_model_len
        self.tensor_parallel_size = tensor_parallel_size
        self.capabilities = self.capabilities_for(hf_config)
        self._weights: dict[int, torch.Tensor] = {}
        #: content keys of the dictionaries every worker holds (each is sent once)
        self._dictionaries: set[str] = set()
        #: held from a request's dictionaries being sent to its submission, and by a drop: a drop
        #: then reaches the workers before or after the request is registered there, never between
        self._dictionary_lock = threading.Lock()
        from . import compat as vllm_compat

        self._loop = EngineLoop(llm.llm_engine, vllm_compat.wrap_block_hasher(llm, OwnBlocks))
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, llm)
        try:  # a model this engine cannot serve faithfully is refused, and its engine stopped
            run_on_loop(self._loop, "interp_guard_kv")
            #: whether a prefill may run only the layers it reads (see vllm_loop)
            self.shortens = all(run_on_loop(self._loop, "interp_depth_limit"))
            if any(read.phase == "select" for read in self.sites.values()):
                unreadable = run_on_loop(self._loop, "interp_unreadable_sites")[0]
                self.capabilities = self.capabilities.serving(self.unserved | frozenset(unreadable))
            self._check_geometry()
        except BaseException:
            self.close()
            raise

    def _repr_extras(self) -> list[str]:
        return [f"tensor_parallel_size={self.tensor_parallel_size}", f"max_model_len={self.max_model_len}"]

    @classmethod
    def capabilities_for(cls, hf_config) -> Capabilities:
        """The capabilities of a model with this config before its engine starts (the engine may
        find more sites it cannot read exactly)."""
        arch = arch_for(hf_config)
        return cls.capabilities.serving(unserved_sites(vllm_sites(arch.family)),
                                        {**vllm_reads.EAGER_ONLY, **arch.vllm_refused})

    @classmethod
    def load(cls, path, name: str, *, dtype: torch.dtype, device: str | None = None, requires_grad: bool = False,
             **options) -> "VllmModel":
        """Start a vLLM engine for ``path`` (see :func:`load_vllm`); vLLM picks its device itself."""
        return load_vllm(path, name, dtype=dtype, **options)

    def _check_geometry(self) -> None:
        """vLLM must run the model the config describes (some of its model classes ignore
        ``head_dim``); otherwise its activations are not this model's."""
        ranks = run_on_loop(self._loop, "interp_geometry", self.arch.vllm_attention)
        heads = sum(r["heads"] for r in ranks)
        head_size = ranks[0]["head_size"]
        if heads != self.info.n_heads or head_size != self.info.d_head:
            raise ValueError(
                f"vLLM runs {self.name} with {heads} heads of size {head_size}, but its config says "
                f"{self.info.n_heads} heads of size {self.info.d_head} (vLLM's {self.arch.family} class derives "
                f"head_dim from hidden_size / num_attention_heads). Its activations would not be this model's: "
                f"use backend='eager' for this checkpoint."
            )

    # -- facts ----------------------------------------------------------------------------------
    def o_proj_weight(self, layer: int) -> torch.Tensor:
        if layer not in self._weights:
            blocks = run_on_loop(self._loop, "interp_o_proj_weight", layer, self.arch.vllm_path("o_proj"))
            self._weights[layer] = torch.cat(blocks, dim=1)
        return self._weights[layer]

    def _fetch_unembedding(self) -> UnembedWeights:
        """The final norm (identical on every rank) and the unembedding, its vocabulary shards
        joined in rank order with vLLM's vocabulary padding cut off."""
        heads = [self.arch.vllm_path("unembed"), self.arch.vllm_path("embed")]
        ranks = run_on_loop(self._loop, "interp_unembedding", self.arch.vllm_path("final_norm"), heads)
        weight = torch.cat([r["weight"] for r in ranks])[: self.info.d_vocab]
        return UnembedWeights(self.hf_config.to_dict(), self.arch.final_norm, ranks[0]["norm"], weight)

    def position_limit(self) -> tuple[int, str]:
        return self.max_model_len, f"this engine's max_model_len={self.max_model_len}"

    def check(self, tokens, points, *, single=None, call="run_with_cache"):
        tokens, addresses = super().check(tokens, points, single=single, call=call)
        if tokens.shape[1] > self.max_model_len:
            raise InputError(
                f"prompt of {tokens.shape[1]} tokens is longer than this engine's max_model_len="
                f"{self.max_model_len}; truncate it (tokens[:, :{self.max_model_len}]) or load the model with a "
                f"larger max_model_len (up to {self.info.n_ctx}): load_model(..., backend='vllm', max_model_len=N)"
            )
        return tokens, addresses

    # -- the calls ------------------------------------------------------------------------------
    def _submit(self, request: Request):
        """Post a checked request to the engine thread; its future holds the finished request."""
        if not request.detach:
            raise InputError(
                "detach=False asks for tensors that keep their autograd graph, and vLLM never builds one "
                "(it runs under inference mode). Use load_model(name, backend='eager', requires_grad=True)."
            )
        tokens, addresses, options = request.tokens, list(request.points), request.options
        positions, edits, features = request.positions, request.edits, request.features
        if edits and self.tensor_parallel_size > 1:
            self._check_sharded_edits(edits)
        wire = sorted({str(self._read_as(a)) for a in addresses})
        sites = features.sites() if features is not None else []
        layers = self._depth(addresses + sites, edits) if options is None and self.shortens else None
        with self._dictionary_lock:
            request = WorkerRequest(
                tuple(wire), None if positions is None else tuple(positions.rows[0]),
                None if positions is None else positions.after[0],
                {str(a): [edit_for_worker(p) for p in chain] for a, chain in edits.items()} if edits else None,
                self._features_for_worker(features) if features is not None else None)
            job = Job(tokens[0].tolist(), sampling_params(options), request, layers, first_needed(request))
            return self._loop.submit(job)

    def _check_sharded_edits(self, edits) -> None:
        """Under tensor parallelism a column-sharded site (``mlp_post``) is split over ranks, so a
        directional edit's projection, a sum over every column, cannot be formed on one rank."""
        for address, chain in edits.items():
            if self.sites[address.name].shard == "cols" and any(isinstance(p.edit, DIRECTIONAL) for p in chain):
                raise InputError(f"edit on {address}: a directional edit projects on a direction across all of "
                                 f"{address.name}'s columns, which tensor parallelism splits over ranks; edit a "
                                 f"replicated site (resid_*, attn_out, mlp_out) or z / q / k / v, or load the model "
                                 f"with tensor_parallel_size=1")

    def _features_for_worker(self, plan) -> list[dict]:
        """The request's dictionary work as the workers take it; each dictionary is sent to every
        worker the first time a request uses it (it stays there under its content key until
        :meth:`drop_dictionary`)."""
        for attached in plan.attached:
            d = attached.dictionary
            if self.tensor_parallel_size > 1:
                sharded = [a for a in (d.reads, d.writes) if self.sites[a.name].shard]
                if sharded:
                    raise InputError(f"{d!r} sits at {sharded[0]}, which tensor parallelism splits over ranks by "
                                     f"{self.sites[sharded[0].name].shard}; dictionaries run on replicated sites "
                                     f"(resid_*, attn_out[_post], mlp_out[_post]) under tensor_parallel_size > 1, or load the "
                                     f"model with tensor_parallel_size=1")
            if d.key not in self._dictionaries:
                run_on_loop(self._loop, "interp_add_dictionary", dictionary_for_worker(d))
                self._dictionaries.add(d.key)
        return features_for_worker(plan)

    def drop_dictionary(self, key: str) -> None:
        """Have every worker forget the dictionary kept under content key ``key`` (a request that
        uses it and is submitted already runs to its end; a later one sends it again)."""
        with self._dictionary_lock:
            if key in self._dictionaries:
                self._dictionaries.discard(key)
                run_on_loop(self._loop, "interp_drop_dictionary", key)

    def _depth(self, addresses: list[Address], edits: dict | None) -> int | None:
        """The layers a prefill reading ``addresses`` (and editing ``edits``) needs: up to its
        deepest layer; None (all, and the logits) if it reads or edits ``logits``."""
        read = [self._read_as(a) for a in addresses] + list(edits or ())
        if not read or any(a.layer is None for a in read):
            return None
        layers = max(a.layer for a in read) + 1
        return layers if layers < self.info.n_layers else None

    def _execute(self, request: Request):
        return self._result(cancel.wait(self._submit(request)), request)

    async def _execute_async(self, request: Request):
        return self._result(await asyncio.wrap_future(self._submit(request)), request)

    def _result(self, finished: Finished, r: Request):
        if r.options is None:
            return self._cache(finished, r.tokens, self._outputs(r), r.positions, r.tokens.shape[1])
        return self._completion(finished, r.tokens, self._outputs(r), r.positions, r.options.top_logprobs)

    @staticmethod
    def _outputs(r: Request) -> list:
        """The points a request's cache holds: its addresses, then its feature points."""
        return list(r.points) + (list(r.features.points) if r.features is not None else [])

    def run_many(self, rows, points, *, positions=None, edits=None, saes=None) -> list[Cache]:
        """``run_with_cache`` of every row, all submitted before any is awaited, so the engine
        batches them (continuous batching, as ``LLM.generate`` does with a list of prompts).
        Each row is checked first: a bad one fails the call before any is submitted (the points
        once for all rows). ``edits``: the same for every row, or a list of each row's own."""
        points = self.check_points(points)
        each = edits if isinstance(edits, list) else [edits] * len(rows)
        calls = [self.request(row, points, positions=positions, edits=e, saes=saes) for row, e in zip(rows, each)]
        futures = [self._submit(r) for r in calls]
        try:
            return [self._stamped(self._cache(cancel.wait(future), r.tokens, self._outputs(r), r.positions,
                                             r.tokens.shape[1]))
                    for future, r in zip(futures, calls)]
        except BaseException:
            for future in futures:  # the engine loop aborts each cancelled request
                future.cancel()
            raise

    def close(self) -> None:
        self._finalizer()

    # -- putting ranks together -----------------------------------------------------------------
    def _completion(self, finished: Finished, tokens, addresses, positions: Selection | None, top: int):
        out = finished.output.outputs[0]
        generated = list(out.token_ids)
        completion = Completion(self.tok.decode(generated), generated, out.finish_reason or "",
                                *scores(out.logprobs, generated, top))
        fed = fed_tokens(tokens, generated)
        return completion, self._cache(finished, fed, addresses, positions, tokens.shape[1])

    def _cache(self, finished: Finished, fed, addresses, positions: Selection | None, prompt: int) -> Cache:
        """The rows the workers kept, checked against the positions asked for."""
        held = held_positions(positions, [prompt], [fed.shape[1]])
        tensors = {a: _ordinary(self._assemble(self._read_as(a), finished.ranks, held[0])) for a in addresses}
        return Cache(tensors, fed, None, self.name, self.backend, None if positions is None else held)

    def _read_as(self, address: Address) -> Address:
        if address.name in SAME_AS and address.name not in self.sites:
            return Address(SAME_AS[address.name], address.layer)
        return address

    def _holders(self, shard: str) -> list[int]:
        """The ranks whose pieces make up a site, in rank order."""
        tp = self.tensor_parallel_size
        if not shard or tp == 1:
            return [0]
        if shard == "kv" and self.info.n_kv_heads < tp:  # each kv head replicated on tp / n_kv ranks
            return list(range(0, tp, tp // self.info.n_kv_heads))
        return list(range(tp))

    def _assemble(self, address, ranks: list[dict], wanted: torch.Tensor) -> torch.Tensor:
        if isinstance(address, FeatureAddress):
            return self._assemble_features(address, ranks[0][str(address)], wanted)
        read = self.sites.get(address.name)
        pieces = []
        for rank in self._holders(read.shard if read else ""):
            rows, positions = ranks[rank][str(address)]
            beyond = positions > wanted[-1]  # the never fed-back final token, should a worker record it
            if bool(beyond.any()):
                rows, positions = rows[~beyond], positions[~beyond]
            if not torch.equal(positions, wanted):
                missing = sorted(set(wanted.tolist()) - set(positions.tolist()))
                raise InternalError(f"[Internal] rank {rank} recorded positions {positions.tolist()} for {address}, "
                                   f"expected {wanted.tolist()} (missing {missing})")
            pieces.append(rows)
        tensor = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
        return split_heads(address.name, tensor, self.info)[None]

    @staticmethod
    def _assemble_features(point: FeatureAddress, item: dict, wanted: torch.Tensor) -> torch.Tensor:
        """A feature point as rank 0 recorded it (sparse rows, or dense ones), ``[1, pos, n]``."""
        positions = item["positions"]
        if "rows" in item:
            rows = item["rows"]
        else:
            rows = SparseRows(item["offsets"], item["ids"], item["values"], int(item["width"])).dense()
        keep = positions <= wanted[-1]  # the never fed-back final token, should a worker record it
        rows, positions = rows[keep], positions[keep]
        if not torch.equal(positions, wanted):
            raise InternalError(f"[Internal] the workers recorded positions {positions.tolist()} for {point}, "
                                f"expected {wanted.tolist()}")
        return rows[None]


def _ordinary(tensor: torch.Tensor) -> torch.Tensor:
    """Rows recorded under vLLM's inference mode become ordinary tensors, so that users can train
    a probe on them (autograd refuses to save inference tensors for backward)."""
    return tensor.clone() if tensor.is_inference() else tensor


def _shutdown(loop: EngineLoop, llm) -> None:
    loop.close()
    stop_engine(llm)


def load_vllm(path, name: str, *, dtype: torch.dtype = torch.float32, tensor_parallel_size: int = 1,
              max_model_len: int | None = None, verbose: bool = False, **options) -> VllmModel:
    """Start a vLLM capture engine for the Hugging Face folder ``path``.

    ``options`` are further ``vllm.LLM`` arguments (``gpu_memory_utilization``, ``max_num_seqs``,
    ``seed``, ...); the few that would change what is captured are fixed (see
    :mod:`.engine`). ``max_model_len`` defaults to the model's context length. What this vLLM
    build cannot run is refused before the engine starts (:mod:`.limits`); vLLM's own INFO and
    WARNING lines are quiet while it starts unless ``verbose=True``.
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    if not has_record(config):
        raise UnsupportedModel(
            f"model_type {config.model_type!r} has no family record, and the generic path (a record found and proven "
            f"on the loaded model) runs on backend='eager' only; load it with backend='eager'")
    info = model_info(config, name)
    vllm_sites(arch_for(config).family)  # an unsupported family fails before the engine starts
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    if info.n_heads % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must divide the {info.n_heads} attention heads of {name}"
        )
    if not isinstance(verbose, bool):
        raise InputError(f"verbose must be True or False, got {verbose!r}")
    max_model_len = int(max_model_len or info.n_ctx)
    if arch_for(config).vllm_transformers_backend:  # its rewrite of the HF classes stays in the worker's process
        options.setdefault("distributed_executor_backend", "mp")
    with quiet_start(verbose):  # reading vLLM's limits imports the parts of it that speak up
        check_limits(info, options)
        options = {**memory_defaults(info, dtype, max_model_len, tensor_parallel_size, options), **options}
        llm = start_engine(engine_options(path, dtype, tensor_parallel_size, max_model_len, options), verbose=verbose)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        return VllmModel(llm, config, tokenizer, name, max_model_len=max_model_len,
                         tensor_parallel_size=tensor_parallel_size, dtype=dtype)
    except BaseException:
        stop_engine(llm)
        raise
