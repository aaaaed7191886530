"""The final norm and the unembedding, for models whose weights live in another process.

The logit lens and logit attribution need two pieces of the model in the caller's process: the
norm applied to the last residual stream, and the unembedding ``W_U`` (``[d_vocab, d_model]``,
plus the final logit softcapping where the family has one). An eager model has them at hand. A
vLLM model holds them in its workers, and a cluster model in its replicas: they are fetched
once, as plain tensors (:class:`UnembedWeights`), and kept.

The norm is rebuilt as the Hugging Face module of the model's own family (taken from a
weightless, meta-device copy of the model built from its config), loaded with the fetched
weights, so it computes exactly what the eager backend's norm computes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .archs import arch_for, has_record
from .wire import Packed


@dataclasses.dataclass(frozen=True)
class UnembedWeights:
    """What crosses processes: the HF config (a dict), the final norm's state dict and ``W_U``."""

    config: dict
    norm_path: str
    norm: dict[str, torch.Tensor]
    weight: torch.Tensor  # [d_vocab, d_model]

    def as_plain(self) -> dict:
        """Numpy arrays and plain values only (for Ray: zero-copy, no torch pickling)."""
        return {"config": self.config, "norm_path": self.norm_path,
                "norm": {k: Packed.of(v) for k, v in self.norm.items()}, "weight": Packed.of(self.weight)}

    @classmethod
    def from_plain(cls, plain: dict) -> "UnembedWeights":
        return cls(plain["config"], plain["norm_path"], {k: v.tensor() for k, v in plain["norm"].items()},
                   plain["weight"].tensor())


class Unembedding:
    """``final_norm`` and ``unembed`` computed in this process from :class:`UnembedWeights`."""

    def __init__(self, weights: UnembedWeights):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = dict(weights.config)
        config = AutoConfig.for_model(config.pop("model_type"), **config)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        norm = skeleton.get_submodule(weights.norm_path).to_empty(device="cpu")
        norm.load_state_dict(weights.norm, strict=True)
        self.norm = norm.eval().requires_grad_(False)
        self.weight = weights.weight
        # a model on the generic path has no softcapping: its proof is logits == unembed(final_norm(x))
        self.softcap = arch_for(config).softcap(config) if has_record(config) else None

    def final_norm(self, resid: torch.Tensor) -> torch.Tensor:
        return self.norm(resid.to(self.weight.device))

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        logits = F.linear(normed.to(self.weight.device, self.weight.dtype), self.weight)
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits


class FetchedUnembedding:
    """Mixed into a model whose weights are elsewhere: ``final_norm`` / ``unembed`` /
    ``unembed_weight`` from weights fetched once by ``_fetch_unembedding()``."""

    _unembed_weights: UnembedWeights | None = None
    _unembedding: Unembedding | None = None

    def _fetch_unembedding(self) -> UnembedWeights:
        raise NotImplementedError

    def unembed_weights(self) -> UnembedWeights:
        """The final norm's and the unembedding's weights, fetched on first use and kept."""
        if self._unembed_weights is None:
            self._unembed_weights = self._fetch_unembedding()
        return self._unembed_weights

    def _lens(self) -> Unembedding:
        if self._unembedding is None:
            self._unembedding = Unembedding(self.unembed_weights())
        return self._unembedding

    def final_norm(self, resid: torch.Tensor) -> torch.Tensor:
        """The norm the model applies to the last ``resid_post`` before unembedding, ``[..., d_model]``."""
        with torch.no_grad():
            return self._lens().final_norm(resid)

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        """``[..., d_model]`` -> ``[..., vocab]`` logits (then the final softcapping, where the family has
        one): ``unembed(final_norm(resid_post.L))`` at the last layer is the model's own logits."""
        with torch.no_grad():
            return self._lens().unembed(normed)

    def unembed_weight(self) -> torch.Tensor:
        """``W_U``, ``[d_vocab, d_model]``: the row of a token is its unembedding direction."""
        return self._lens().weight
