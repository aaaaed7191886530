"""Random sparse dictionaries sized for the tiny test models (d_model 128), and the hand-written
Hugging Face hooks the feature tests compare against (written out here, not taken from the
library, so the oracle does not share the code under test)."""

from __future__ import annotations

import contextlib
import math
import torch

from interp_engine.features import load_dictionary

D_MODEL, D_SAE = 128, 384


def random_weights(seed: int, d_in: int = D_MODEL, d_sae: int = D_SAE, d_out: int | None = None,
                   scale: float = 1.0) -> dict:
    """Weights whose ReLU is sparse on the tiny models' activations (norm ~1 on the residual,
    ~0.1 on block outputs: ``scale=10`` there): a negative encoder bias."""
    g = torch.Generator().manual_seed(seed)
    d_out = d_out or d_in
    return {"W_enc": torch.randn(d_in, d_sae, generator=g) * scale,
            "b_enc": torch.full((d_sae,), -0.5) + 0.01 * torch.randn(d_sae, generator=g),
            "W_dec": torch.randn(d_sae, d_out, generator=g) / math.sqrt(d_sae),
            "b_dec": 0.05 * torch.randn(d_out, generator=g)}


def sae(reads="resid_post.1", seed=0, **options):
    """A ReLU SAE (``k=`` for TopK, ``threshold`` in options' weights for JumpReLU)."""
    weights = random_weights(seed, scale=10.0 if str(reads).startswith(("mlp_out", "attn_out")) else 1.0)
    if options.pop("jumprelu", False):
        weights["threshold"] = torch.full((D_SAE,), 0.3)
    return load_dictionary(weights, reads=reads, name=f"sae{seed}", **options)


def transcoder(reads="resid_mid.1", writes="mlp_out.1", seed=3, skip=False):
    weights = random_weights(seed)
    weights["W_dec"] = weights["W_dec"] * 0.1  # the MLP's output is ~0.1 in norm
    if skip:
        weights["W_skip"] = 0.05 * torch.randn(D_MODEL, D_MODEL, generator=torch.Generator().manual_seed(seed + 1))
    return load_dictionary(weights, reads=reads, writes=writes, name=f"tc{seed}")


def pre_by_hand(d, x: torch.Tensor) -> torch.Tensor:
    """The encoder's pre-activations of ``x`` (float64), b_dec on the input where the dictionary says."""
    xin = x.double() - (d.b_dec.double() if d.apply_b_dec_to_input else 0)
    return xin @ d.W_enc.double() + d.b_enc.double()


def encode_by_hand(d, x: torch.Tensor) -> torch.Tensor:
    """The features of ``x`` from the formulas (ReLU / JumpReLU / TopK, b_dec on the input
    where the dictionary says; no normalisation), for the dictionaries above."""
    pre = pre_by_hand(d, x)
    if d.activation == "relu":
        return pre.clamp(min=0)
    if d.activation == "jumprelu":
        return torch.where(pre > d.threshold.double(), pre.clamp(min=0), torch.zeros_like(pre))
    keep = pre.topk(d.k, dim=-1).indices
    return torch.zeros_like(pre).scatter(-1, keep, pre.gather(-1, keep).clamp(min=0))


def decode_by_hand(d, f: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    out = f.double() @ d.W_dec.double() + d.b_dec.double()
    if d.W_skip is not None:
        out = out + x.double() @ d.W_skip.double().T
    return out


@contextlib.contextmanager
def layer_output_hook(model, layer: int, fn, module: str = ""):
    """Replace the output of ``module`` of decoder layer ``layer`` (``""``: the layer, whose output
    is resid_post) with ``fn(output)`` for the duration of the block."""
    target = model.hf.model.layers[layer]
    if module:
        target = target.get_submodule(module)

    def hook(mod, args, out):
        if isinstance(out, tuple):
            return (fn(out[0]), *out[1:])
        return fn(out)

    handle = target.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
