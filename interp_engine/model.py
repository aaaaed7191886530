"""The model handle every backend returns, and the calls users write.

``load_model(...)`` returns a :class:`CaptureModel`: the eager backend, the vLLM backend and the
cluster-backed model all implement the same few methods, so ``run_with_cache(model, tokens,
points)`` is one call whatever runs the model. Switching backend is the ``backend=`` argument
and nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .address import Address, AddressLike, ModelInfo, check_points
from .cache import Cache
from .tokens import InputError, Tokenizer, check_tokens


@dataclasses.dataclass(frozen=True)
class Completion:
    """What ``capture_generation`` generated for one prompt."""

    text: str
    token_ids: list[int]
    finish_reason: str = ""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Generation options shared by every backend. Greedy (temperature 0) by default."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InputError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 means no top-k), got {self.top_k}")


class CaptureModel:
    """A loaded model that captures activations. Backends subclass it.

    Subclasses set ``info``, ``tok`` and ``backend`` and implement ``_run``, ``_generate`` and
    ``_capture``; this class validates what users pass in, so every backend gives the same errors.
    """

    backend: str = ""
    info: ModelInfo
    tok: Tokenizer
    #: sites this backend cannot read exactly (they get a clear error instead)
    unserved: frozenset[str] = frozenset()
    #: whether a call may carry a batch of several prompts
    batched: bool = True

    # -- facts ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.info.name

    @property
    def n_layers(self) -> int:
        return self.info.n_layers

    @property
    def d_model(self) -> int:
        return self.info.d_model

    @property
    def n_heads(self) -> int:
        return self.info.n_heads

    @property
    def d_head(self) -> int:
        return self.info.d_head

    @property
    def d_mlp(self) -> int:
        return self.info.d_mlp

    def to_tokens(self, text: str | list[str]) -> torch.Tensor:
        """``"text"`` -> ``[1, pos]`` token ids; a list -> a right-padded batch (see tokens.py)."""
        return self.tok.to_tokens(text)

    def o_proj_weight(self, layer: int) -> torch.Tensor:
        """The attention output projection of ``layer``, ``[d_model, n_heads * d_head]``."""
        raise NotImplementedError(f"the {self.backend} backend does not expose weights")

    # -- validation shared by all backends ------------------------------------------------------
    def check(self, tokens, points, *, single: bool | None = None) -> tuple[torch.Tensor, list[Address]]:
        tokens = check_tokens(
            tokens, self.info.d_vocab, self.info.n_ctx, single=(not self.batched) if single is None else single
        )
        addresses = check_points(points, self.info, self.backend, self.unserved)
        return tokens, addresses

    # -- the calls ------------------------------------------------------------------------------
    def run_with_cache(self, tokens, points, *, detach: bool = True) -> Cache:
        tokens, addresses = self.check(tokens, points)
        return self._run(tokens, addresses, detach=detach)

    def capture_generation(self, tokens, points, *, max_tokens: int = 16, **sampling) -> tuple[Completion, Cache]:
        options = Sampling(max_tokens=max_tokens, **sampling)
        tokens, addresses = self.check(tokens, points, single=True)
        return self._generate(tokens, addresses, options)

    async def capture(self, tokens, points, **sampling) -> dict[Address, torch.Tensor]:
        """Async capture of one prompt: a plain dict keyed by Address (a string is a KeyError).

        Many calls may be in flight at once; each gets exactly its own rows. With
        ``max_tokens=N`` it also generates and captures the generated positions.
        """
        options = Sampling(**sampling) if sampling else None
        tokens, addresses = self.check(tokens, points, single=True)
        return await self._capture(tokens, addresses, options)

    def close(self) -> None:
        """Release the engine and its processes. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- what a backend implements --------------------------------------------------------------
    def _run(self, tokens: torch.Tensor, addresses: list[Address], *, detach: bool) -> Cache:
        raise NotImplementedError

    def _generate(self, tokens: torch.Tensor, addresses: list[Address], options: Sampling) -> tuple[Completion, Cache]:
        raise NotImplementedError

    async def _capture(self, tokens, addresses, options: Sampling | None) -> dict[Address, torch.Tensor]:
        raise NotImplementedError


def run_with_cache(model: CaptureModel, tokens, points: list[AddressLike], *, detach: bool = True) -> Cache:
    """Run ``tokens`` through ``model`` and return the activations at ``points`` as a Cache.

    ``points`` holds Addresses, their string forms (``"resid_post.10"``) or tuples. With
    ``detach=False`` (eager, ``load_model(..., requires_grad=True)``) the tensors keep their graph.
    """
    return model.run_with_cache(tokens, points, detach=detach)


def capture_generation(model: CaptureModel, tokens, points, *, max_tokens: int = 16, **sampling: Any):
    """Generate from one prompt and capture ``points`` at every prompt and generated position.

    Returns ``(completion, cache)``. The cache has ``len(prompt) + len(generated) - 1``
    positions: the final sampled token is never fed back through the model.
    """
    return model.capture_generation(tokens, points, max_tokens=max_tokens, **sampling)
