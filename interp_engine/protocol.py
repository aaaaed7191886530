"""The backend contract, written down: what every model offers, and what some models add.

:class:`CaptureBackend` is the surface every model that ``load_model`` returns implements: the
eager and vLLM backends, and the cluster-backed model whatever its replicas run. Code that takes
"a model" (the analysis helpers, ``build_dataset``) may rely on it and nothing more.

Three capabilities come on top, each a small runtime-checkable Protocol, so that code which needs
one asks ``isinstance(model, HasUnembedding)`` instead of probing attribute names:

- :class:`HasUnembedding`: the final norm and the unembedding in this process (the logit lens,
  logit attribution); every backend has it, a vLLM or cluster model fetches the weights once;
- :class:`HasOProj`: each layer's attention output projection (head contributions);
- :class:`WritesShards`: the model writes dataset shards itself (a cluster model: its replicas
  write them); other models are handed one shard at a time by ``build_dataset``.

The Protocols are for type hints and checks: backends implement them by subclassing
:class:`~interp_engine.model.CaptureModel` (which supplies the shared part), not by naming them.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class CaptureBackend(Protocol):
    """What every model offers: facts about it, its tokenizer, and the capture calls."""

    #: "eager" or "vllm" (a cluster model: what its replicas run)
    backend: str
    #: the model's shape and name (``ModelInfo``)
    info: Any
    #: the dtype the weights are held in: "float32", "bfloat16" or "float16"
    dtype: str
    #: whether ``run_with_cache`` takes a batch of several prompts
    batched: bool
    #: sites this backend cannot read exactly
    unserved: frozenset

    @property
    def name(self) -> str: ...

    @property
    def n_layers(self) -> int: ...

    def facts(self) -> dict:
        """``model_dtype`` and ``weights_sha256``: what a dataset manifest records."""
        ...

    def points(self, site: str | None = None) -> list: ...

    def to_tokens(self, text, *, prepend_bos: bool | None = None) -> torch.Tensor: ...

    def to_str_tokens(self, text_or_tokens, *, prepend_bos: bool | None = None): ...

    def to_string(self, tokens): ...

    def chat_tokens(self, messages, *, add_generation_prompt: bool = False): ...

    def run_with_cache(self, tokens, points, *, detach: bool = True, positions=None, edits=None): ...

    def capture_generation(self, tokens, points, *, max_tokens: int = 16, positions=None, edits=None,
                           **sampling): ...

    async def capture_generation_async(self, tokens, points, *, max_tokens: int = 16, positions=None,
                                       edits=None, **sampling): ...

    async def capture(self, tokens, points, *, positions=None, edits=None, **sampling) -> dict: ...

    def close(self) -> None: ...


@runtime_checkable
class HasUnembedding(Protocol):
    """The final norm and the unembedding, computed in the caller's process."""

    def final_norm(self, resid: torch.Tensor) -> torch.Tensor: ...

    def unembed(self, normed: torch.Tensor) -> torch.Tensor: ...

    def unembed_weight(self) -> torch.Tensor: ...

    def unembed_weights(self) -> Any:
        """The weights as plain tensors (``UnembedWeights``), to ship to another process."""
        ...


@runtime_checkable
class HasOProj(Protocol):
    """Each layer's attention output projection, ``[d_model, n_heads * d_head]``."""

    def o_proj_weight(self, layer: int) -> torch.Tensor: ...


@runtime_checkable
class WritesShards(Protocol):
    """A model that writes dataset shards itself (a cluster model: on its replicas)."""

    def write_shards(self, spec, source, skip) -> Iterator: ...


def missing(model, capability: type, used: tuple[str, ...] = ()) -> str:
    """For an error message: the methods of ``capability`` that ``model`` lacks ("a or b"),
    those among ``used`` (the ones the caller calls) first."""
    members = [n for n in vars(capability) if not n.startswith("_") and callable(vars(capability)[n])]
    lacking = [n for n in members if not callable(getattr(model, n, None))]
    return " or ".join([n for n in lacking if n in used] or lacking)


def require(model, capability: type, what: str, needs: str, used: tuple[str, ...] = ()) -> None:
    """Raise a TypeError unless ``model`` has ``capability``: ``what`` names the caller, ``needs``
    what it needs from the model, ``used`` the methods it calls."""
    if isinstance(model, capability):
        return
    raise TypeError(
        f"{what} needs {needs}, and {type(model).__name__} has no {missing(model, capability, used)}: "
        f"pass the model that load_model(...) returned (every backend and cluster model has it)"
    )
