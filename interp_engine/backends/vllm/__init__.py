"""The vLLM backend. Two sides, two processes.

This package's modules run in the calling process: ``model.py`` (:class:`~.model.VllmModel`),
``engine.py`` (starting and stopping the engine), ``loop.py`` (the thread that drives it) and
``compat.py`` (every private vLLM structure the project reaches, used by both sides).
:mod:`.worker` runs inside vLLM's worker processes (one per tensor-parallel rank; in this process
when there is one rank) and is reached only through ``collective_rpc``.
"""
