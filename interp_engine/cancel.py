"""Cancellation: a capture whose caller gave up stops, instead of keeping the model busy.

A cancelled ``await model.capture(...)`` (an abandoned task, a timeout) returns at once to its
caller, but the work itself runs elsewhere — in a worker thread (the eager backend), in the
vLLM engine's thread, or in a replica process (a cluster) — and nothing can interrupt it from
outside. So the work is *watched*: it carries a stop check (a function that answers True once
its caller has given up) and calls :func:`checkpoint` where stopping is safe — when it has
taken the model, and between decode steps. There :func:`checkpoint` raises :class:`Cancelled`;
the hooks are removed on the way out as after any error, and the model serves the next call.

The stop check lives in a context variable, so each request (each thread) has its own and a
plain synchronous call, which runs without one, never stops. Who sets it:

- :func:`in_thread` (the eager backend's async calls): a flag set when the awaiting task is
  cancelled;
- a replica (``actors/replica.py``): Ray's flag for its task, which ``ray.cancel`` of the
  caller's request sets (recursively, through the coordinator) — queued calls never start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from .errors import Cancelled

#: how often a synchronous wait on another thread's work (the vLLM engine's) asks the stop check
POLL_S = 0.02

_stop_check: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "interp_engine_stop_check", default=None)


@contextlib.contextmanager
def watching(stop_check: Callable[[], bool] | None) -> Iterator[None]:
    """Run the block with ``stop_check`` as this context's stop check (None: never stop)."""
    token = _stop_check.set(stop_check)
    try:
        yield
    finally:
        _stop_check.reset(token)


def cancelled() -> bool:
    """Whether the caller of the work running in this context has given up."""
    check = _stop_check.get()
    return bool(check is not None and check())


def checkpoint(where: str = "") -> None:
    """Raise :class:`Cancelled` if the caller gave up; a safe place to stop is ``where``."""
    if cancelled():
        raise Cancelled(f"the capture was cancelled by its caller{' ' + where if where else ''}")


def wait(future: concurrent.futures.Future):
    """``future.result()``, but under a stop check the future is cancelled (which the vLLM engine
    loop turns into an abort of its request) and :class:`Cancelled` raised once the caller gives up."""
    if _stop_check.get() is None:
        return future.result()
    while True:
        try:
            return future.result(timeout=POLL_S)
        except concurrent.futures.TimeoutError:
            if cancelled():
                future.cancel()
                raise Cancelled("the capture was cancelled by its caller while it waited for the engine") from None


async def in_thread(fn: Callable, *args, **kwargs):
    """``await asyncio.to_thread(fn, ...)`` that stops ``fn`` at its next :func:`checkpoint` when
    the awaiting task is cancelled (``asyncio.to_thread`` alone leaves the thread running)."""
    stop = threading.Event()

    def watched():
        with watching(stop.is_set):
            return fn(*args, **kwargs)

    try:
        return await asyncio.to_thread(watched)
    except asyncio.CancelledError:
        stop.set()
        raise
