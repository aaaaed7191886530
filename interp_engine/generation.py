"""Generation, as every backend offers it: the sampling options and what comes back.

:class:`Sampling` holds the options of ``capture_generation`` (greedy by default), checked once
here so that every backend, and the wire to a cluster, sees the same plain numbers and gives the
same errors. :class:`Completion` is the text and token ids generated for one prompt.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import torch

from .errors import InputError, shown
from .scalars import integer, real


@dataclasses.dataclass(frozen=True)
class Completion:
    """What ``capture_generation`` generated for one prompt.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the model: ``log_softmax`` of
    the logits that chose it, before temperature, top-k and top-p (the model's own distribution,
    vLLM's ``raw_logprobs``). With ``top_logprobs=k``, ``top_logprobs[i]`` holds step ``i``'s ``k``
    most likely tokens as ``{token id: logprob}``, most likely first."""

    text: str
    token_ids: list[int]
    finish_reason: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    def scores(self) -> dict:
        """``logprobs`` and ``top_logprobs`` as JSON data (each step's top tokens as ``[[id,
        logprob], ...]`` in order), as they cross to a cluster replica or over HTTP."""
        top = None if self.top_logprobs is None else [[[t, p] for t, p in step.items()] for step in self.top_logprobs]
        return {"logprobs": self.logprobs, "top_logprobs": top}

    @classmethod
    def of(cls, text: str, token_ids, finish_reason: str, scores: dict | None = None) -> "Completion":
        """The completion a reply describes (``scores``: what :meth:`scores` wrote, or None)."""
        scores = scores or {}
        top = scores.get("top_logprobs")
        return cls(text, [int(t) for t in token_ids], finish_reason,
                   None if scores.get("logprobs") is None else [float(p) for p in scores["logprobs"]],
                   None if top is None else [{int(t): float(p) for t, p in step} for step in top])


@dataclasses.dataclass(frozen=True)
class Step:
    """One token of a streamed generation (``model.stream``), as it is chosen: its index, id,
    text, logprob (and top tokens with ``top_logprobs=k``), and the captures of the forward that
    chose it, ``{address: tensor}``: step 0's cover the prompt, step ``i``'s the one position fed
    at step ``i`` (token ``i - 1``); concatenated along positions they are ``capture_generation``'s
    cache (a pattern's key axis grows by one each step)."""

    index: int
    token_id: int
    text: str
    logprob: float
    top_logprobs: dict[int, float] | None
    captures: dict


def step_scores(logits: torch.Tensor, token: int, top: int) -> tuple[float, dict[int, float] | None]:
    """The log-probability of ``token`` under a ``[vocab]`` logit vector and, when ``top`` > 0,
    the ``top`` most likely tokens ``{id: logprob}`` (most likely first)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if not top:
        return float(logprobs[token]), None
    values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
    return float(logprobs[token]), dict(zip(ids.tolist(), values.tolist()))


#: the most alternatives per step ``top_logprobs`` may ask for (vLLM's default ``max_logprobs``)
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Generation options shared by every backend. Greedy (temperature 0) by default."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_at_eos: bool = True
    #: how many of each step's most likely tokens ``Completion.top_logprobs`` holds (0: none)
    top_logprobs: int = 0

    def __post_init__(self):
        # Each check names the option, the value and the valid range; values are normalised to
        # plain Python numbers so that every backend (and the wire to a cluster) sees the same.
        self._set("max_tokens", _integer(self.max_tokens, "max_tokens", "a positive int", low=1))
        self._set("temperature", _real(self.temperature, "temperature", "a finite number >= 0 (0 is greedy)",
                                       ok=lambda t: t >= 0))
        self._set("top_p", _real(self.top_p, "top_p", "a number in (0, 1] (1 keeps every token)",
                                 ok=lambda p: 0 < p <= 1))
        self._set("top_k", _integer(self.top_k, "top_k", "an int >= 0 (0 means no top-k)", low=0))
        if self.seed is not None:
            self._set("seed", _integer(self.seed, "seed", "None or an int in [0, 2**63)", low=0, high=2**63 - 1))
        self._set("top_logprobs", _integer(self.top_logprobs, "top_logprobs",
                                           f"an int in [0, {MAX_TOP_LOGPROBS}] (0: only the sampled token's "
                                           f"logprob)", low=0, high=MAX_TOP_LOGPROBS))
        if not isinstance(self.stop_at_eos, bool):
            raise InputError(f"stop_at_eos must be True or False, got {shown(self.stop_at_eos)}")

    def _set(self, field: str, value) -> None:
        object.__setattr__(self, field, value)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "Sampling":
        """``Sampling(**options)``, where an unknown keyword is an :class:`InputError` that names
        the valid ones (and the closest, for a typo such as ``temprature=``)."""
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InputError(f"unknown generation option {key!r}{hint}; the options are {', '.join(valid)}")
        return cls(**options)

    def check_length(self, prompt: int, limit: int, what: str) -> None:
        """Refuse a generation that could run past ``limit`` positions (``what`` names the limit):
        a prompt of ``prompt`` tokens plus ``max_tokens`` must fit, as vLLM counts it."""
        if prompt + self.max_tokens <= limit:
            return
        fix = (f"use max_tokens <= {limit - prompt} or a shorter prompt" if prompt < limit
               else f"shorten the prompt below {limit} tokens")
        raise InputError(
            f"a prompt of {prompt} tokens plus max_tokens={self.max_tokens} needs {prompt + self.max_tokens} "
            f"positions, more than {what}; {fix}"
        )


def _integer(value, name: str, valid: str, *, low: int, high: int | None = None) -> int:
    number = integer(value)
    if number is None or number < low or (high and number > high):
        raise InputError(f"{name} must be {valid}, got {shown(value)}")
    return number


def _real(value, name: str, valid: str, *, ok) -> float:
    number = real(value)
    if number is None or not math.isfinite(number) or not ok(number):
        raise InputError(f"{name} must be {valid}, got {shown(value)}")
    return number
