"""Reading the MoE selection vLLM actually used. Written against vLLM 0.32.0.

In vLLM 0.32 an MoE layer's experts are a ``MoERunner`` (``mlp.experts``; Mixtral:
``block_sparse_moe.experts``). On the *modular* path — the CPU backend, Triton on GPUs — the
runner asks its router for the selection, ``runner.router.select_experts(hidden_states,
router_logits, ...) -> (topk_weights, topk_ids)``, and hands exactly that pair to the expert
kernel. While a capture needs it, :func:`wrap_call` wraps that one bound method on the router
*instance* (never the class) and restores it afterwards, so what is recorded is the object the
kernel receives, not a re-derivation. On the *monolithic* path the kernel routes internally
and no Python call carries the selection: :func:`unreadable_sites` reports the selection sites
as unserved, and the address check points to ``router_logits`` + ``expert_assignment``.

A site table marks such a read with phase ``"call"`` and a dotted path ending in the method
(``"mlp.experts.router.select_experts"``); the path is followed by attribute, because the router
is a plain object rather than a submodule.
"""

from __future__ import annotations

from collections.abc import Callable


def resolve(root, path: str):
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


def wrap_call(root, path: str, callback: Callable) -> _Restore:
    """Wrap the method at ``root.<path>`` on its instance: each call runs as before, then
    ``callback(owner, args, result)`` sees the result (integer tensors as int64, the eager
    backend's index dtype; vLLM gets its own result back untouched). ``remove()`` restores it."""
    owner_path, _, method = path.rpartition(".")
    owner = resolve(root, owner_path)
    if owner is None or not callable(getattr(owner, method, None)):
        raise RuntimeError(f"[Internal] no method {path!r} on {type(root).__name__} (vLLM 0.32.0 layout assumed)")
    if method in owner.__dict__:
        raise RuntimeError(f"[Internal] {path!r} is already wrapped")
    original = getattr(owner, method)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        seen = result if isinstance(result, (tuple, list)) else (result,)
        callback(owner, args, tuple(t if t.is_floating_point() else t.long() for t in seen))
        return result

    setattr(owner, method, wrapper)
    return _Restore(owner, method)


def unreadable_sites(layers, table: dict) -> list[str]:
    """Sites of ``table`` read through a ``"call"`` that this engine never makes: the method's
    owner is missing, or its MoE runner routes inside a monolithic kernel."""
    out = []
    for name, read in table.items():
        if read.phase != "call":
            continue
        owner_path = read.module.rpartition(".")[0]
        runner_path = owner_path.rpartition(".")[0]
        owners = [(resolve(layer, owner_path), resolve(layer, runner_path)) for layer in layers]
        present = [(owner, runner) for owner, runner in owners if owner is not None]
        monolithic = any(
            bool(getattr(resolve(runner, "routed_experts.quant_method"), "is_monolithic", False))
            for _, runner in present
        )
        if not present or monolithic:
            out.append(name)
    return out
