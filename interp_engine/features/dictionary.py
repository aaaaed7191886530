"""A sparse dictionary (an SAE or a transcoder) as plain tensors and the maths that runs it.

A dictionary reads an activation ``x`` at one address and writes features ``f = encode(x)``,
``[..., d_sae]``, most of them zero. Its reconstruction ``decode(f)`` approximates the activation
at the address it writes: the same address for an SAE, a later one for a transcoder (which reads
the MLP's input side and predicts what the MLP adds). What it misses is the *error term*,
``target - decode(f)``, which the engine keeps so that an edit of the features changes only what
the features explain.

The maths (one formula per option, as SAELens and Gemma Scope define them):

- input normalisation: ``constant_norm_rescale`` (``x * sqrt(d_in) / |x|``, undone on the way
  out), ``layer_norm`` (``(x - mean) / (std + 1e-5)``, undone on the way out), ``scale``
  (``x * s`` in, ``/ s`` out: SAELens's ``expected_average_only_in`` with its factor);
- ``apply_b_dec_to_input``: ``x - b_dec`` before the encoder;
- pre-activations ``x @ W_enc + b_enc`` (times each decoder row's norm when
  ``rescale_by_decoder_norm``, which divides the features by it again before decoding);
- activations: ``relu``; ``jumprelu`` (``relu(pre) * (pre > threshold)``); ``topk`` (the ``k``
  largest pre-activations of each token, through a ReLU, the rest zero);
- ``decode(f) = f @ W_dec + b_dec`` (undoing the normalisation for an SAE) plus, for a
  transcoder with a skip connection, ``x @ W_skip.T``.

Everything here is a pure function of tensors, so the same code runs in the eager hooks, in each
vLLM worker and in each replica.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from ..address import Address
from ..errors import DictionaryError
from ..scalars import integer, real

#: the activation functions a dictionary may use
ACTIVATIONS = ("relu", "jumprelu", "topk")
#: the input normalisations (see the module docstring)
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm", "scale")
_LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Normalized:
    """An input after the dictionary's normalisation, with what undoes it: ``out * mul + add``."""

    x: torch.Tensor
    mul: torch.Tensor | float = 1.0
    add: torch.Tensor | float = 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class Dictionary:
    """An SAE or a transcoder: its weights (``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``,
    ``W_dec [d_sae, d_out]``, ``b_dec [d_out]``), where it reads and writes, and the options that
    change its maths (see the module docstring). Build one with :func:`load_dictionary`.

    Every way one is made (a file, a dict of tensors, an upload to a service, a worker's copy)
    goes through the same check: shapes that fit, options that exist and apply, every weight
    finite, and the layers it sits at named by number."""

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    #: the address whose activation it encodes
    reads: Address
    #: the address its reconstruction predicts (None: ``reads``, an SAE)
    writes: Address | None = None
    activation: str = "relu"
    threshold: torch.Tensor | None = None
    k: int | None = None
    apply_b_dec_to_input: bool = False
    normalize: str = "none"
    norm_scale: float | None = None
    rescale_by_decoder_norm: bool = False
    #: a transcoder's skip connection, ``[d_out, d_in]`` (None: none)
    W_skip: torch.Tensor | None = None
    name: str = ""

    def __post_init__(self):
        for option, read in (("k", integer), ("norm_scale", real)):  # numpy scalars and 0-d tensors count
            value = getattr(self, option)
            if value is not None and read(value) is not None:
                object.__setattr__(self, option, read(value))
        _check(self)
        if self.writes is None:
            object.__setattr__(self, "writes", self.reads)

    # -- facts -------------------------------------------------------------------------------
    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def is_transcoder(self) -> bool:
        return self.writes != self.reads

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def __repr__(self) -> str:
        kind = "Transcoder" if self.is_transcoder else "SAE"
        where = f"{self.reads}" + (f" -> {self.writes}" if self.is_transcoder else "")
        act = f"topk(k={self.k})" if self.activation == "topk" else self.activation
        return f"{kind}({self.name or 'unnamed'!r}, {where}, d_in={self.d_in}, d_sae={self.d_sae}, {act})"

    @property
    def key(self) -> str:
        """A content hash of the weights and options: two dictionaries with the same key compute
        the same thing (a vLLM worker keeps each one it was sent under this key)."""
        cached = self.__dict__.get("_key")
        if cached is None:
            digest = hashlib.sha256()
            for field in dataclasses.fields(self):
                value = getattr(self, field.name)
                digest.update(field.name.encode())
                if isinstance(value, torch.Tensor):
                    data = value.detach().cpu().contiguous()
                    digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
                    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
                else:
                    digest.update(repr(value).encode())
            cached = digest.hexdigest()[:16]
            object.__setattr__(self, "_key", cached)
        return cached

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Dictionary":
        """The same dictionary with its tensors on ``device`` (and in ``dtype``)."""
        changes = {f.name: getattr(self, f.name).to(device=device, dtype=dtype)
                   for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **changes)

    # -- the maths ---------------------------------------------------------------------------
    def normalized(self, x: torch.Tensor) -> Normalized:
        """``x`` (``[..., d_in]``) in the dictionary's dtype, normalised as it was trained."""
        x = x.to(self.dtype)
        if self.normalize == "constant_norm_rescale":
            coeff = math.sqrt(self.d_in) / x.norm(dim=-1, keepdim=True)
            return Normalized(x * coeff, 1.0 / coeff)
        if self.normalize == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            centred = x - mu
            std = centred.std(dim=-1, keepdim=True)
            return Normalized(centred / (std + _LN_EPS), std, mu)
        if self.normalize == "scale":
            return Normalized(x * self.norm_scale, 1.0 / self.norm_scale)
        return Normalized(x)

    def pre_activations(self, normed: Normalized) -> torch.Tensor:
        """``[..., d_sae]``: what the activation function is applied to."""
        x = normed.x - self.b_dec if self.apply_b_dec_to_input else normed.x
        pre = x @ self.W_enc + self.b_enc
        if self.rescale_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        return pre

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """The features, ``[..., d_sae]``, from the pre-activations."""
        if self.activation == "relu":
            return pre.relu()
        if self.activation == "jumprelu":
            return pre.relu() * (pre > self.threshold).to(pre.dtype)
        values, ids = pre.topk(self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, ids, values.relu())

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d_in]`` -> the features ``[..., d_sae]``."""
        return self.activate(self.pre_activations(self.normalized(x)))

    def _undo(self, normed: Normalized | None) -> tuple:
        """``(mul, add)`` that take the decoder's output back to the activation's units: an SAE
        undoes its input normalisation; a transcoder's output was never normalised."""
        if self.is_transcoder or self.normalize == "none":
            return 1.0, 0.0
        if self.normalize == "scale":
            return 1.0 / self.norm_scale, 0.0
        if normed is None:
            raise DictionaryError(f"{self!r} normalises its input ({self.normalize}): decode(f, normed) needs the "
                                  f"normalised input the features came from (dictionary.normalized(x))")
        return normed.mul, normed.add

    def decode(self, f: torch.Tensor, normed: Normalized | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction ``[..., d_out]`` of the features ``f``. An SAE that normalises its
        input per token needs the ``normed`` input the features came from (to undo it); a
        transcoder with a skip connection needs its raw input ``x``."""
        mul, add = self._undo(normed)
        if self.rescale_by_decoder_norm:
            f = f / self.W_dec.norm(dim=-1)
        out = f @ self.W_dec + self.b_dec
        if not (isinstance(mul, float) and mul == 1.0):
            out = out * mul
        if not (isinstance(add, float) and add == 0.0):
            out = out + add
        if self.W_skip is not None:
            if x is None:
                raise DictionaryError(f"{self!r} has a skip connection: decode(f, x=...) needs its input")
            out = out + x.to(self.dtype) @ self.W_skip.T
        return out

    def decode_change(self, df: torch.Tensor, normed: Normalized | None = None) -> torch.Tensor:
        """What a change ``df`` of the features changes in the reconstruction. The decoder is
        linear in the features, so this is ``decode(f + df) - decode(f)`` computed directly: it
        is exactly zero wherever ``df`` is."""
        mul, _ = self._undo(normed)
        if self.rescale_by_decoder_norm:
            df = df / self.W_dec.norm(dim=-1)
        out = df @ self.W_dec
        return out if isinstance(mul, float) and mul == 1.0 else out * mul

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features, reconstruction)`` of ``x``."""
        normed = self.normalized(x)
        f = self.activate(self.pre_activations(normed))
        return f, self.decode(f, normed, x)


def _check(d: Dictionary) -> None:
    """Shapes that fit together and options that exist, or a :class:`DictionaryError` saying which."""
    what = f"dictionary {d.name or '(unnamed)'}"
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        value = getattr(d, name)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise DictionaryError(f"{what}: {name} must be a floating-point tensor, got {type(value).__name__}")
    _check_finite(d, what)
    if d.W_enc.dim() != 2 or d.W_dec.dim() != 2:
        raise DictionaryError(f"{what}: W_enc and W_dec must be matrices ([d_in, d_sae] and [d_sae, d_out]), got "
                              f"{list(d.W_enc.shape)} and {list(d.W_dec.shape)}")
    d_in, d_sae = d.W_enc.shape
    if d.W_dec.shape[0] != d_sae:
        hint = " (it looks transposed: W_dec is [d_sae, d_out])" if d.W_dec.shape[1] == d_sae else ""
        raise DictionaryError(f"{what}: W_enc is [d_in={d_in}, d_sae={d_sae}] but W_dec is {list(d.W_dec.shape)}{hint}")
    if tuple(d.b_enc.shape) != (d_sae,) or tuple(d.b_dec.shape) != (d.W_dec.shape[1],):
        raise DictionaryError(f"{what}: b_enc must be [{d_sae}] and b_dec [{d.W_dec.shape[1]}], got "
                              f"{list(d.b_enc.shape)} and {list(d.b_dec.shape)}")
    if d.activation not in ACTIVATIONS:
        raise DictionaryError(f"{what}: unknown activation {d.activation!r}; known: {', '.join(ACTIVATIONS)}")
    if d.activation == "jumprelu" and (d.threshold is None or tuple(d.threshold.shape) != (d_sae,)):
        raise DictionaryError(f"{what}: a jumprelu dictionary needs a threshold of shape [{d_sae}], got "
                              f"{None if d.threshold is None else list(d.threshold.shape)}")
    if d.activation == "topk" and (isinstance(d.k, bool) or not isinstance(d.k, int) or not 0 < d.k <= d_sae):
        raise DictionaryError(f"{what}: a topk dictionary needs an int k in 1..{d_sae}, got {d.k!r}")
    if d.threshold is not None and d.activation != "jumprelu":
        raise DictionaryError(f"{what}: it holds a threshold, which only a jumprelu dictionary uses, but its "
                              f"activation is {d.activation!r}; pass activation='jumprelu', or leave the threshold out")
    if d.k is not None and d.activation != "topk":
        raise DictionaryError(f"{what}: k={d.k!r} applies to a topk dictionary only, but its activation is "
                              f"{d.activation!r}; pass activation='topk', or leave k out")
    for site, role in ((d.reads, "reads"), (d.writes, "writes")):
        if site is not None and site.layer is not None and site.layer < 0:
            raise DictionaryError(f"{what}: it {role} {site}, a layer counted from the end, but a dictionary "
                                  f"sits at one numbered layer of the model it was trained on; name that layer "
                                  f"(on an n-layer model, -1 is n - 1), e.g. load_dictionary(path, "
                                  f"{role}='{site.name}.11') for the last layer of a 12-layer model (pass {role}= "
                                  f"to override a hook such as 'blocks.-1.hook_{site.name}' in cfg.json)")
    if d.normalize not in NORMALIZATIONS:
        raise DictionaryError(f"{what}: unknown normalisation {d.normalize!r}; known: {', '.join(NORMALIZATIONS)}")
    if d.normalize == "scale" and not (isinstance(d.norm_scale, float) and math.isfinite(d.norm_scale)
                                       and d.norm_scale > 0):
        raise DictionaryError(f"{what}: normalize='scale' needs a finite positive norm_scale, got {d.norm_scale!r}")
    transcoder = d.writes is not None and d.writes != d.reads
    if not transcoder and d.W_dec.shape[1] != d_in:
        raise DictionaryError(f"{what}: an SAE reconstructs its input, so d_out must equal d_in={d_in}, got "
                              f"{d.W_dec.shape[1]}; a transcoder names the address it writes (writes=...)")
    if transcoder and d.apply_b_dec_to_input:
        raise DictionaryError(f"{what}: apply_b_dec_to_input does not apply to a transcoder (b_dec lives at "
                              f"{d.writes}, not at {d.reads})")
    if transcoder and d.normalize in ("constant_norm_rescale", "layer_norm"):
        raise DictionaryError(f"{what}: a transcoder's input normalisation {d.normalize!r} cannot be undone at "
                              f"the address it writes; only 'none' and 'scale' are supported for transcoders")
    if d.W_skip is not None and tuple(d.W_skip.shape) != (d.W_dec.shape[1], d_in):
        raise DictionaryError(f"{what}: W_skip must be [d_out, d_in] = [{d.W_dec.shape[1]}, {d_in}], got "
                              f"{list(d.W_skip.shape)}")
    if d.W_skip is not None and not transcoder:
        raise DictionaryError(f"{what}: a skip connection (W_skip) belongs to a transcoder; name the address it "
                              f"writes (writes=...)")


#: the dictionary's tensors, each checked to hold only finite numbers
_TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")


def _check_finite(d: Dictionary, what: str) -> None:
    """Every weight finite: one NaN in ``W_enc`` makes the features of every token NaN (and an
    edit of them NaN logits); a NaN threshold silently switches every feature off."""
    for name in _TENSORS:
        value = getattr(d, name)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.device.type == "meta":
            continue
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            count = int(bad.sum())
            first = [int(i) for i in bad.nonzero()[0]]
            raise DictionaryError(
                f"{what}: {name} ({str(value.dtype).removeprefix('torch.')}) holds {count} non-finite value"
                f"{'s' if count > 1 else ''} (NaN or inf) of {value.numel()}, the first {value[tuple(first)].item()} "
                f"at index {first}; a NaN or inf weight makes the features and every edit through them NaN. "
                f"Load a checkpoint whose weights are finite (or, for a dtype= conversion, one whose values fit "
                f"that dtype)")
