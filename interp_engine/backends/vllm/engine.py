"""Building and stopping the vLLM engine that the vLLM backend captures from.

Some engine options would silently change what is captured, so they are fixed here and a
caller who asks otherwise gets an error that says why:

- ``enforce_eager=True``: with compiled graphs, hooks registered after start-up never fire.
  Cost: no torch.compile / CUDA graphs (slower decode on GPU; on CPU it also skips warm-up).
- prefix caching is **on** (vLLM's default), usable by capturing requests: a request reads cached
  blocks only before the first position it captures or edits (:mod:`.prefix`). A user may turn
  it off (``enable_prefix_caching=False``) and pay for recomputing shared prefixes.
- chunked prefill is **on** (vLLM's default, ``max_num_batched_tokens`` vLLM's default too): a
  prompt longer than a step's token budget is prefilled over several forwards, and each row is
  filed by its (request, position), so the chunks join into the same capture.
- no speculative decoding: draft tokens would run positions that are later rejected.
- ``async_scheduling=False``: the engine never schedules a step past a request's end.

On CPU, vLLM's own default reserves ``gpu_memory_utilization`` (0.92) of the host's RAM and
refuses to start when other processes use more than the rest. When the caller sets neither
``VLLM_CPU_KVCACHE_SPACE`` nor ``kv_cache_memory_bytes`` / ``gpu_memory_utilization``, the engine
reserves a KV cache sized from the model instead (:func:`cpu_kv_cache_bytes`), and a start-up that
still runs out of memory is an error that names what to set (:class:`EngineMemoryError`).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). With
``tensor_parallel_size > 1`` vLLM starts one worker process per rank; on a CPU with one NUMA
node each rank needs its own cores, so ``VLLM_CPU_OMP_THREADS_BIND`` is set (``"0|1"`` style)
unless the caller set it. vLLM caches its environment variables once an engine starts; the
cache is cleared before a new engine reads them (:mod:`.compat`). Several engines may serve in one process at once; stopping one leaves the
others' shared distributed state in place (:func:`stop_engine`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch
from interp_engine.errors import EngineMemoryError

#: engine options the backend fixes, and why a different value would break capture
FIXED_OPTIONS = {
    "enforce_eager": (True, "compiled graphs skip the capture hooks"),
    "async_scheduling": (False, "the engine could run a step past a request's end"),
    "speculative_config": (None, "draft tokens run positions that are later rejected"),
}


GiB = 1 << 30
#: the CPU KV cache default holds this many sequences of max_model_len tokens ...
DEFAULT_SEQUENCES = 8
#: ... within vLLM's own CPU default (VLLM_CPU_KVCACHE_SPACE=4) and a quarter of the free memory
DEFAULT_CAP = 4 * GiB
#: a floor, so that many short prompts fit at once on tiny models
DEFAULT_FLOOR = 64 << 20


def kv_bytes_per_token(info, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of KV cache one token takes on one rank (keys and values of every layer)."""
    kv_heads = max(1, info.n_kv_heads // tensor_parallel_size)
    return 2 * info.n_layers * kv_heads * info.d_head * torch.empty((), dtype=dtype).element_size()


def cpu_kv_cache_bytes(info, dtype: torch.dtype, max_model_len: int, tensor_parallel_size: int = 1,
                       available: int | None = None) -> int:
    """The KV cache (bytes per rank) a CPU engine reserves when the caller chose none:
    ``DEFAULT_SEQUENCES`` full-length sequences, at least ``DEFAULT_FLOOR``, at most
    ``DEFAULT_CAP`` and a quarter of the memory ``available`` now; never less than one
    full-length sequence (if that does not fit, :class:`EngineMemoryError`)."""
    import psutil

    available = psutil.virtual_memory().available if available is None else available
    one = kv_bytes_per_token(info, dtype, tensor_parallel_size) * max_model_len
    cap = min(DEFAULT_CAP, available // (4 * tensor_parallel_size))
    if one > cap:
        raise EngineMemoryError(
            f"one sequence of max_model_len={max_model_len} tokens of {info.name} needs {one / GiB:.2f} GiB of KV "
            f"cache per rank, more than the default allows ({cap / GiB:.2f} GiB: at most 4 GiB and a quarter of the "
            f"{available / GiB:.1f} GiB free). Lower max_model_len (load_model(..., backend='vllm', max_model_len=N)) "
            f"or choose the size: VLLM_CPU_KVCACHE_SPACE=<GiB> in the environment, or kv_cache_memory_bytes=<bytes>."
        )
    return max(one, min(cap, max(DEFAULT_FLOOR, DEFAULT_SEQUENCES * one)))


def memory_defaults(info, dtype: torch.dtype, max_model_len: int, tensor_parallel_size: int, options: dict) -> dict:
    """``kv_cache_memory_bytes`` for a CPU engine whose caller chose no memory setting, else nothing."""
    from vllm.platforms import current_platform

    chosen = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(options)
    if not current_platform.is_cpu() or chosen or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return {}
    return {"kv_cache_memory_bytes": cpu_kv_cache_bytes(info, dtype, max_model_len, tensor_parallel_size)}


def engine_options(path, dtype: torch.dtype, tensor_parallel_size: int, max_model_len: int, options: dict) -> dict:
    """The keyword arguments of ``vllm.LLM`` for a capture engine (caller's options checked)."""
    options = dict(options)
    for key, (value, why) in FIXED_OPTIONS.items():
        if key in options and options[key] != value:
            raise ValueError(
                f"{key}={options[key]!r} is not allowed on the vLLM capture backend: {why}. "
                f"It is always {value!r}; drop the option."
            )
        options.pop(key, None)
    if "worker_extension_cls" in options:
        raise ValueError("worker_extension_cls is set by the vLLM capture backend itself; drop the option")
    if "compilation_config" in options:
        raise ValueError("compilation_config is not allowed on the vLLM capture backend: compiled graphs skip "
                         "the capture hooks, so it always runs eagerly. Drop the option.")
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        if options.get(key, 1) != 1:
            raise ValueError(
                f"{key}={options[key]} is not supported by the vLLM capture backend: it reads every layer "
                f"from the ranks of one model replica. Use tensor_parallel_size, or several replicas "
                f"(load_model(..., replicas=N))."
            )
    if tensor_parallel_size > 1:
        options.setdefault("distributed_executor_backend", "mp")
    options.setdefault("enable_prefix_caching", True)
    return dict(
        model=str(path),
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len,
        worker_extension_cls="interp_engine.backends.vllm.worker.extension.CaptureExtension",
        disable_log_stats=True,
        seed=options.pop("seed", 0),
        **{key: value for key, (value, _) in FIXED_OPTIONS.items()},
        **options,
    )


def _thread_binding(tensor_parallel_size: int) -> str:
    """``"0|1"``: one group of this process's cores per rank (reused if there are fewer cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        groups = [[cores[r % len(cores)]] for r in range(tensor_parallel_size)]
    else:
        size = len(cores) // tensor_parallel_size
        groups = [cores[r * size : (r + 1) * size] for r in range(tensor_parallel_size)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


@contextlib.contextmanager
def _environment(tensor_parallel_size: int):
    from vllm.platforms import current_platform

    from . import compat as vllm_compat

    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if tensor_parallel_size > 1 and current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        wanted["VLLM_CPU_OMP_THREADS_BIND"] = _thread_binding(tensor_parallel_size)
    previous = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    vllm_compat.clear_env_cache()
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Engines started by this module and not stopped yet. Their engine cores all live in this
# process and share vLLM's process-wide distributed state (the TP=1 worker's groups).
_LIVE: set[int] = set()
_LIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_start(verbose: bool = False):
    """vLLM's INFO and WARNING lines off while its engine starts (a page of them, none of which
    the user can act on here), unless ``verbose=True`` or the user chose a level themselves
    (``VLLM_LOGGING_LEVEL``). Errors still print. Worker processes started meanwhile (tensor
    parallelism) read the same level from the environment when they import vLLM."""
    if verbose or os.environ.get("VLLM_LOGGING_LEVEL"):
        yield
        return
    logger = logging.getLogger("vllm")
    before = logger.level
    logger.setLevel(logging.ERROR)
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        logger.setLevel(before)


def start_engine(options: dict, *, verbose: bool = False):
    """A started ``vllm.LLM`` built from :func:`engine_options` (quiet unless ``verbose``)."""
    from vllm import LLM

    with _environment(options["tensor_parallel_size"]), quiet_start(verbose):
        try:
            llm = LLM(**options)
        except ValueError as err:
            if "memory" not in str(err).lower():
                raise
            raise EngineMemoryError(
                f"the vLLM engine could not reserve its memory: {err} Choose the KV cache size instead of a "
                f"fraction of RAM: VLLM_CPU_KVCACHE_SPACE=<GiB> in the environment (CPU), or "
                f"load_model(..., backend='vllm', kv_cache_memory_bytes=<bytes>); without either (and without "
                f"gpu_memory_utilization) the CPU backend sizes it from the model."
            ) from None
    with _LIVE_LOCK:
        _LIVE.add(id(llm))
    return llm


def stop_engine(llm) -> None:
    """Shut the engine core and its worker processes down.

    Shutting an engine core down also tears down vLLM's process-wide distributed state, which
    any other engine still serving in this process is using; so while others are live the
    teardown is skipped, and the last engine to stop does the full shutdown.
    """
    if getattr(llm, "llm_engine", None) is None:
        return
    from . import compat as vllm_compat

    with _LIVE_LOCK:
        _LIVE.discard(id(llm))
        others = bool(_LIVE)
    vllm_compat.shutdown_engine(llm, keep_distributed=others)
