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

from .address import Address, AddressLike, ModelInfo, all_points, check_points
from .cache import Cache
from .positions import Selection, check_spec, resolve
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

    def to_tokens(self, text: str | list[str], *, prepend_bos: bool | None = None) -> torch.Tensor:
        """``"text"`` -> ``[1, pos]`` token ids; a list -> a right-padded batch (see tokens.py).
        ``prepend_bos``: None = the tokenizer's own special tokens, True/False = force a BOS / none."""
        return self.tok.to_tokens(text, prepend_bos=prepend_bos)

    def to_str_tokens(self, text_or_tokens, *, prepend_bos: bool | None = None):
        """Each token as text: ``"text"`` or ``[1, pos]`` -> ``list[str]``; a batch -> one list per row."""
        return self.tok.to_str_tokens(text_or_tokens, prepend_bos=prepend_bos)

    def to_string(self, tokens):
        """Token ids back to text: ``[pos]`` / ``[1, pos]`` / a list of ids -> ``str``; a batch -> ``list[str]``."""
        return self.tok.to_string(tokens)

    def points(self, site: str | None = None) -> list[Address]:
        """Every address this model serves on this backend, in forward order (layer by layer,
        sites in the order of the site table, ``logits`` last); ``site`` keeps one site's."""
        return all_points(self.info, self.backend, self.unserved, site)

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

    @staticmethod
    def _selection(tokens: torch.Tensor, positions, options: Sampling | None = None) -> Selection | None:
        """``positions=`` resolved against each row of a checked batch (see positions.py)."""
        lengths = (tokens >= 0).sum(dim=1).tolist()
        return resolve(check_spec(positions), lengths, generating=options is not None,
                       max_tokens=options.max_tokens if options else None)

    # -- the calls ------------------------------------------------------------------------------
    def run_with_cache(self, tokens, points, *, detach: bool = True, positions=None) -> Cache:
        tokens, addresses = self.check(tokens, points)
        return self._run(tokens, addresses, detach=detach, positions=self._selection(tokens, positions))

    def capture_generation(self, tokens, points, *, max_tokens: int = 16, positions=None,
                           **sampling) -> tuple[Completion, Cache]:
        options = Sampling(max_tokens=max_tokens, **sampling)
        tokens, addresses = self.check(tokens, points, single=True)
        return self._generate(tokens, addresses, options, positions=self._selection(tokens, positions, options))

    async def capture(self, tokens, points, *, positions=None, **sampling) -> dict[Address, torch.Tensor]:
        """Async capture of one prompt: a plain dict keyed by Address (a string is a KeyError).

        Many calls may be in flight at once; each gets exactly its own rows. With
        ``max_tokens=N`` it also generates and captures the generated positions. With
        ``positions=`` each tensor holds the selected positions only, in position order.
        """
        options = Sampling(**sampling) if sampling else None
        tokens, addresses = self.check(tokens, points, single=True)
        return await self._capture(tokens, addresses, options, positions=self._selection(tokens, positions, options))

    def close(self) -> None:
        """Release the engine and its processes. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- what a backend implements --------------------------------------------------------------
    # ``positions`` is None (every position) or a Selection resolved against ``tokens``; the
    # backend applies it where each activation is produced.
    def _run(self, tokens: torch.Tensor, addresses: list[Address], *, detach: bool,
             positions: Selection | None = None) -> Cache:
        raise NotImplementedError

    def _generate(self, tokens: torch.Tensor, addresses: list[Address], options: Sampling, *,
                  positions: Selection | None = None) -> tuple[Completion, Cache]:
        raise NotImplementedError

    async def _capture(self, tokens, addresses, options: Sampling | None, *,
                       positions: Selection | None = None) -> dict[Address, torch.Tensor]:
        raise NotImplementedError


def run_with_cache(model: CaptureModel, tokens, points: list[AddressLike], *, detach: bool = True,
                   positions=None) -> Cache:
    """Run ``tokens`` through ``model`` and return the activations at ``points`` as a Cache.

    ``points`` holds Addresses, their string forms (``"resid_post.10"``), tuples, whole sites
    (``"resid_post"``: every layer) or a filter (``lambda a: a.layer == 3``). ``positions``
    keeps only some positions (``-1``: each row's last token; see :mod:`.positions`). With
    ``detach=False`` (eager, ``load_model(..., requires_grad=True)``) the tensors keep their graph.
    """
    return model.run_with_cache(tokens, points, detach=detach, positions=positions)


def capture_generation(model: CaptureModel, tokens, points, *, max_tokens: int = 16, positions=None,
                       **sampling: Any):
    """Generate from one prompt and capture ``points`` at every prompt and generated position.

    Returns ``(completion, cache)``. The cache has ``len(prompt) + len(generated) - 1``
    positions: the final sampled token is never fed back through the model. ``positions``
    keeps fewer (``"generated"``: the generated ones only; ``-1``: the last prompt token).
    """
    return model.capture_generation(tokens, points, max_tokens=max_tokens, positions=positions, **sampling)
