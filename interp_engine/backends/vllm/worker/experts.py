"""Reading the MoE selection vLLM actually used.

An MoE layer's experts are run by an MoE runner (``mlp.experts``; Mixtral:
``block_sparse_moe.experts``). On the *modular* path — the CPU backend, Triton on GPUs — the
runner asks its router for the selection through one Python call, which returns
``(topk_weights, topk_ids)``, and hands exactly that pair to the expert kernel. While a capture
needs it, :func:`wrap_selection` wraps that one bound method on the router *instance* (never the
class) and restores it afterwards, so what is recorded is the object the kernel receives, not a
re-derivation. On the *monolithic* path the kernel routes internally and no Python call carries
the selection: :func:`unreadable_sites` reports the selection sites as unserved, and the address
check points to ``router_logits`` + ``expert_assignment``.

A site table marks such a read with phase ``"select"`` and the path of the MoE runner; where
the router and its method live inside the runner is vLLM's private structure
(:func:`.vllm_compat.moe_selection`).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import compat as vllm_compat
from interp_engine.errors import InternalError


def submodule(root, path: str):
    """Follow a dotted attribute path from ``root`` (``None`` where it breaks off)."""
    for name in path.split(".") if path else ():
        root = getattr(root, name, None)
        if root is None:
            return None
    return root


class _Restore:
    def __init__(self, owner, method: str):
        self.owner, self.method = owner, method

    def remove(self) -> None:
        self.owner.__dict__.pop(self.method, None)


def wrap_selection(root, path: str, callback: Callable) -> _Restore:
    """Wrap the selection call of the MoE runner at ``root.<path>`` on its instance: each call
    runs as before, then ``callback(owner, args, result)`` sees the result (integer tensors as
    int64, the eager backend's index dtype; vLLM gets its own result back untouched).
    ``remove()`` restores it."""
    found = vllm_compat.moe_selection(submodule(root, path))
    if found is None:
        raise InternalError(f"[Internal] no expert selection call under {path!r} of {type(root).__name__} "
                           f"(vLLM {vllm_compat.SUPPORTED} layout assumed)")
    owner, method = found
    if method in owner.__dict__:
        raise InternalError(f"[Internal] the selection under {path!r} is already wrapped")
    original = getattr(owner, method)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        seen = result if isinstance(result, (tuple, list)) else (result,)
        callback(owner, args, tuple(t if t.is_floating_point() else t.long() for t in seen))
        return result

    setattr(owner, method, wrapper)
    return _Restore(owner, method)


def unreadable_sites(layers, table: dict) -> list[str]:
    """Sites of ``table`` read through a ``"select"`` call that this engine never makes: no layer
    has the call, or an MoE runner routes inside a monolithic kernel."""
    out = []
    for name, read in table.items():
        if read.phase != "select":
            continue
        runners = [submodule(layer, read.module) for layer in layers]
        present = [r for r in runners if r is not None and vllm_compat.moe_selection(r) is not None]
        if not present or any(vllm_compat.moe_is_monolithic(r) for r in present):
            out.append(name)
    return out
