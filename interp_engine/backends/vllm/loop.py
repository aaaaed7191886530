"""One thread that owns the vLLM engine and drives its step loop.

Every capture — ``run_with_cache``, ``capture_generation`` and each ``await model.capture(...)``
— becomes a :class:`Job` posted to this thread. Between engine steps the thread admits the new
jobs (``add_request``, then registers their points on every worker), runs one ``step()`` for
all running requests together (continuous batching), and for each request that finished takes
its recorded rows from the workers and resolves the job's future. Synchronous calls wait on
the future; async ones await it. Because only this thread touches the engine, hooks, row
bookkeeping and ``collective_rpc`` never race.

The thread starts with the intra-op thread count of the thread that built the engine. vLLM's
CPU attention sizes its work split by the calling thread's OpenMP team when it builds the
metadata and checks it again in the kernel; a fresh thread's team size changes at its first
parallel torch op, so it is fixed up front (:func:`.vllm_compat.pin_torch_threads`: vLLM
replaces ``torch.set_num_threads`` with a no-op in a process that hosts a CPU worker).

A job whose future is cancelled (an abandoned ``await``) is aborted in the engine. An engine
failure fails every job in flight, and later calls, with the original error attached.

**Running fewer layers.** A prefill-only job whose deepest point is in layer ``L`` needs layers
``0 .. L`` and nothing after them (not even the logits: its one sampled token is thrown away).
Before each step the loop looks at every job the engine holds: when all of them carry such a
depth (``Job.layers``), the workers run only the deepest one's layers
(``interp_set_depth``); as soon as one job needs them all — a generation, a ``logits`` point,
an edit there, a job without a depth — the step runs every layer, and an idle engine is always
left whole. A step's batch is drawn from the jobs the engine holds, so no request that reads
the later layers or the logits is ever computed by a shortened model; the layers a shortened
step runs compute exactly what they compute in a full one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import queue
import threading
import time
from typing import Any

import torch
from interp_engine.errors import EngineStopped
from interp_engine.wire import WorkerRequest
from .prefix import OwnBlocks, depth_salt


#: An idle engine that receives a job keeps admitting for as long as more jobs follow within
#: this many seconds of each other (at most ``BURST_LIMIT`` in all), so that a burst of
#: captures — ``asyncio.gather`` of many ``model.capture`` calls — is prefilled in one forward
#: instead of a first forward of the one or two that arrived first and a second of the rest.
BURST_GAP = 0.005
BURST_LIMIT = 0.1


@dataclasses.dataclass
class Job:
    prompt: list[int]
    params: Any  # vllm.SamplingParams
    #: what the workers record and edit for this request (points, positions, edits)
    request: WorkerRequest = WorkerRequest()
    #: how many layers this job needs (a prefill whose deepest point is in layer ``layers - 1``);
    #: None: every layer and the logits
    layers: int | None = None
    #: the first position this job captures or edits (:func:`.prefix.first_needed`): no cached
    #: block may hold it or any later one; None: the job may share every cached block
    first_needed: int | None = None
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    internal_id: str = ""


@dataclasses.dataclass
class Finished:
    """A finished request: vLLM's ``RequestOutput`` and, per rank, ``{address: (rows, positions)}``."""

    output: Any
    ranks: list[dict]


def _resolve(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # cancelled by its caller
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class EngineLoop:
    def __init__(self, engine, prefix: OwnBlocks | None = None):
        self.engine = engine  # vllm.v1.engine.llm_engine.LLMEngine
        #: the engine's block hasher (None: prefix caching off), told each job's first needed position
        self._prefix = prefix
        self._threads = torch.get_num_threads()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._closed = False
        self._depth: int | None = None  # layers the workers run now (None: all)
        #: how many steps ran with fewer layers than the model has (for tests and benchmarks)
        self.shortened_steps = 0
        self._thread = threading.Thread(target=self._run, name="interp-vllm-engine", daemon=True)
        self._thread.start()

    # -- called from any thread -----------------------------------------------------------------
    def submit(self, job: Job) -> concurrent.futures.Future:
        self._check_open()
        self._inbox.put(("job", job))
        return job.future

    def call(self, method: str, *args) -> concurrent.futures.Future:
        """``collective_rpc(method, args)`` between steps; the future holds one result per rank."""
        self._check_open()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (method, args), future))
        return future

    def close(self, timeout: float = 60.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(("stop",))
        self._thread.join(timeout)
        self._drain(EngineStopped("this model was closed; load_model(...) again to capture"))

    def _check_open(self) -> None:
        if self._error is not None:
            raise EngineStopped(f"the vLLM engine failed earlier and cannot serve: {self._error!r}") from self._error
        if self._closed:
            raise EngineStopped("this model was closed; load_model(...) again to capture")

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            from .compat import pin_torch_threads

            pin_torch_threads(self._threads)
            while True:
                idle = not self.engine.has_unfinished_requests()
                if idle and self._depth is not None:  # an idle engine is left whole
                    self._set_depth(None)
                if not self._admit(block=idle):
                    break
                self._abort_cancelled()
                if self.engine.has_unfinished_requests():
                    self._set_depth(self._needed_depth())
                    self.shortened_steps += self._depth is not None
                    self._finish([o for o in self.engine.step() if o.finished])
        except BaseException as err:  # the engine is unusable now: tell everyone waiting
            self._error = err
        finally:
            error = self._error or EngineStopped("the model was closed while this capture was running")
            for job in self._jobs.values():
                _resolve(job.future, error=error)
            self._jobs.clear()
            self._drain(error)

    def _admit(self, block: bool) -> bool:
        """Take everything posted so far; False on stop. With ``block`` (the engine is idle),
        wait for one item, then for the rest of its burst (``BURST_GAP``)."""
        new: dict[str, dict] = {}
        item = self._inbox.get() if block else self._next(None)
        until = time.monotonic() + BURST_LIMIT if block else None
        while item is not None:
            if item[0] == "stop":
                self._register(new)
                return False
            if item[0] == "call":
                self._register(new)
                new = {}
                (method, args), future = item[1], item[2]
                try:
                    _resolve(future, self.engine.collective_rpc(method, args=args))
                except Exception as err:
                    _resolve(future, error=err)
            else:
                self._add(item[1], new)
            item = self._next(until)
        self._register(new)
        return True

    def _next(self, until: float | None):
        """The next posted item: waiting up to ``BURST_GAP`` for it until ``until``, else only if
        one is there already (None when there is none)."""
        left = until - time.monotonic() if until is not None else 0.0
        try:
            if left > 0:
                return self._inbox.get(timeout=min(BURST_GAP, left))
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _needed_depth(self) -> int | None:
        """The layers the jobs the engine holds need: None if any needs them all."""
        depths = [job.layers for job in self._jobs.values()]
        if not depths or None in depths:
            return None
        return max(depths)

    def _set_depth(self, layers: int | None) -> None:
        if layers != self._depth:
            self.engine.collective_rpc("interp_set_depth", args=(layers,))
            self._depth = layers

    def _add(self, job: Job, new: dict[str, dict]) -> None:
        if job.future.cancelled():
            return
        external = f"interp{next(self._ids)}"
        prompt = {"prompt_token_ids": job.prompt}
        if self._prefix is not None:
            if job.first_needed is not None:  # read before add_request: vLLM hashes the prompt there
                self._prefix.rules[external] = job.first_needed
            if job.layers is not None:
                prompt["cache_salt"] = depth_salt(job.layers)
        try:
            job.internal_id = self.engine.add_request(external, prompt, job.params)
        except Exception as err:  # an input vLLM refuses: fail this job only
            self._forget(external)
            _resolve(job.future, error=err)
            return
        self._jobs[external] = job
        if not job.request.empty:  # plain generation: nothing to register
            new[job.internal_id] = job.request.to_rpc()

    def _register(self, new: dict[str, dict]) -> None:
        if new:
            self.engine.collective_rpc("interp_register", args=(new,))

    def _abort_cancelled(self) -> None:
        gone = [external for external, job in self._jobs.items() if job.future.cancelled()]
        if gone:
            self.engine.abort_request(gone)
            self.engine.collective_rpc("interp_release", args=([self._jobs[e].internal_id for e in gone],))
            for external in gone:
                del self._jobs[external]
                self._forget(external)

    def _finish(self, outputs: list) -> None:
        outputs = [o for o in outputs if o.request_id in self._jobs]
        if not outputs:
            return
        jobs = [self._jobs.pop(o.request_id) for o in outputs]
        for output in outputs:
            self._forget(output.request_id)
        taken = [job.internal_id for job in jobs if not job.request.empty]
        ranks = self.engine.collective_rpc("interp_take", args=(taken,)) if taken else []
        for output, job in zip(outputs, jobs):
            _resolve(job.future, Finished(output, [rank.get(job.internal_id, {}) for rank in ranks]))

    def _forget(self, external: str) -> None:
        if self._prefix is not None:
            self._prefix.rules.pop(external, None)

    def _drain(self, error: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            future = item[1].future if item[0] == "job" else item[2] if item[0] == "call" else None
            if future is not None:
                _resolve(future, error=error)


def run_on_loop(loop: EngineLoop, method: str, *args) -> list:
    """Blocking :meth:`EngineLoop.call`."""
    return loop.call(method, *args).result()

