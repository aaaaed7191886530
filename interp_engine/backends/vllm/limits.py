"""What the installed vLLM build cannot run, checked before its engine starts.

A model or an option outside vLLM's limits otherwise fails tens of seconds into the engine's
start-up with a traceback from deep inside vLLM (on the CPU build, a tiny model with ``head_dim``
16: the attention backend's selection refuses it). These checks run on the model's config and
the options, before anything starts, and raise an :class:`~interp_engine.InputError` that names
the limit and what to do. The limits themselves are read from vLLM (:mod:`.compat`), not copied;
docs/VLLM.md lists them.
"""

from __future__ import annotations

from interp_engine.errors import InputError

from . import compat


def check_limits(info, options: dict) -> None:
    """Refuse a model (its :class:`~interp_engine.points.ModelInfo`) or engine ``options`` this
    vLLM build cannot run."""
    if not compat.is_cpu_platform():
        return
    sizes, multiple = compat.cpu_attention_limits()
    if info.d_head not in sizes:
        raise InputError(
            f"{info.name} has attention heads of size {info.d_head} (head_dim), and vLLM's CPU attention kernel "
            f"takes head sizes {', '.join(map(str, sizes))} only: this vLLM build cannot run it. Use "
            f"backend='eager' for this model (or a model whose head_dim is one of those)")
    block = options.get("block_size")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block % multiple):
        raise InputError(
            f"block_size={block!r}: vLLM's CPU attention kernel takes KV cache blocks of a multiple of {multiple} "
            f"tokens; pass block_size={multiple * max(1, round(block / multiple)) if isinstance(block, int) else multiple} "
            f"or leave it out (the CPU build picks 128)")
