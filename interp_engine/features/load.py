"""Dictionaries from local files: SAELens folders, Gemma Scope ``params.npz``, plain tensors.

Nothing is downloaded: :func:`load_dictionary` reads what is on disk (or in memory) and returns
a :class:`~.dictionary.Dictionary`. The formats:

- **SAELens** (a folder holding ``cfg.json`` and ``sae_weights.safetensors``). Configs written
  by SAELens 6 (``metadata.sae_lens_version`` >= 6: ``architecture`` names the maths,
  ``metadata.hook_name`` / ``hook_name_out`` where it reads / writes) and before it (the
  v5 layout: ``hook_name`` or ``hook_point`` at the top, TopK as ``activation_fn_str: "topk"``
  with ``activation_fn_kwargs.k``, a ``finetuning_scaling_factor`` that multiplies the features
  before decoding). Architectures: ``standard``, ``jumprelu``, ``topk``, ``batchtopk`` (a
  training checkpoint: run, as SAELens saves it for inference, as JumpReLU at its learnt
  threshold), ``transcoder``, ``skip_transcoder``, ``jumprelu_transcoder``,
  ``jumprelu_skip_transcoder``. A config that names no ``architecture`` is ``standard``, or
  ``jumprelu`` where the weights hold a ``threshold`` (never a ReLU that drops it). The config
  and the weights must agree, as SAELens itself requires: a tensor the architecture does not use
  (a threshold beside ``standard`` or ``topk``), or a ``d_in`` / ``d_sae`` / ``d_out`` that is not
  the weights' own, is a :class:`~interp_engine.errors.DictionaryError`.
- **Gemma Scope** (``params.npz``, or a folder holding one): JumpReLU, no ``b_dec`` on the input;
  the file does not say where it reads, so pass ``reads=`` (and ``writes=`` for a transcoder).
  It is read as numeric arrays only: nothing in it is ever unpickled.
- **A plain dict** of tensors ``W_enc``, ``b_enc``, ``W_dec``, ``b_dec`` (and ``threshold`` for
  JumpReLU, ``W_skip`` for a skip transcoder) with ``reads=`` and the options as arguments.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..address import Address, SITES
from ..dtypes import to_dtype
from ..errors import AddressError
from ..errors import DictionaryError
from .dictionary import Dictionary
from .hooks import hook_address, hook_name

#: SAELens architecture -> (activation, transcoder, skip connection)
ARCHITECTURES = {
    "standard": ("relu", False, False),
    "jumprelu": ("jumprelu", False, False),
    "topk": ("topk", False, False),
    "batchtopk": ("jumprelu", False, False),
    "transcoder": ("relu", True, False),
    "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
#: SAELens's normalize_activations -> ours ("expected_average_only_in" needs its factor)
_NORMALIZE = {"none": "none", None: "none", False: "none", "constant_norm_rescale": "constant_norm_rescale",
              "layer_norm": "layer_norm", "expected_average_only_in": "scale", True: "scale"}
#: sites a dictionary may read or write: one vector per position, written where it is made
#: (z flattens its heads: ``[n_heads * d_head]``)
DICTIONARY_SITES = ("resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post", "resid_post", "z",
                    "mlp_post", "resid_streams", "ln1_normalized", "attn_in", "ln2_normalized", "mlp_in", "mlp_pre",
                    "mlp_pre_linear")
_CFG = "cfg.json"
_WEIGHTS = "sae_weights.safetensors"
_NPZ = "params.npz"


def load_dictionary(source, *, reads=None, writes=None, activation: str | None = None, k: int | None = None,
                    norm_scaling_factor: float | None = None, apply_b_dec_to_input: bool | None = None,
                    name: str | None = None, dtype=None, device=None) -> Dictionary:
    """A dictionary from ``source``: a SAELens folder, a Gemma Scope ``params.npz`` (or its folder),
    or a dict of tensors (see the module docstring).

    ``reads`` / ``writes``: the addresses it reads and predicts (our form ``"resid_post.3"`` or a
    TransformerLens hook name); they override what a config says. ``activation`` (``"relu"``,
    ``"jumprelu"``, ``"topk"``) and ``k`` for a plain dict. ``norm_scaling_factor``: the factor of
    SAELens's ``expected_average_only_in`` normalisation (kept with the release, not in the
    folder). ``dtype`` / ``device``: where the weights go (default: as stored, on the CPU).
    """
    if isinstance(source, dict):
        return _from_tensors(source, reads=reads, writes=writes, activation=activation, k=k,
                             norm_scaling_factor=norm_scaling_factor, apply_b_dec_to_input=apply_b_dec_to_input,
                             name=name, dtype=dtype, device=device)
    if not isinstance(source, (str, Path)):
        raise DictionaryError(f"load_dictionary takes a folder or file path or a dict of tensors, got "
                              f"{type(source).__name__}")
    path = Path(source)
    if path.is_dir() and (path / _CFG).is_file():
        return _from_saelens(path, reads=reads, writes=writes, k=k, norm_scaling_factor=norm_scaling_factor,
                             name=name, dtype=dtype, device=device)
    npz = path / _NPZ if path.is_dir() else path
    if npz.is_file() and npz.suffix == ".npz":
        tensors = _read_npz(npz)
        return _from_tensors(tensors, reads=reads, writes=writes, activation=activation or "jumprelu", k=k,
                             norm_scaling_factor=norm_scaling_factor,
                             apply_b_dec_to_input=bool(apply_b_dec_to_input), name=name or path.name,
                             dtype=dtype, device=device, where=str(npz))
    if not path.exists():
        raise DictionaryError(f"{path}: no such file or folder; pass a SAELens folder (cfg.json + "
                              f"{_WEIGHTS}), a Gemma Scope params.npz or a dict of tensors")
    raise DictionaryError(f"{path} is neither a SAELens folder (it holds no {_CFG}) nor a .npz file (Gemma Scope's "
                          f"{_NPZ}); pass one of those or a dict of tensors")


def _read_npz(path: Path) -> dict[str, torch.Tensor]:
    """The arrays of an ``.npz`` file (a zip of ``.npy`` arrays, as ``numpy.savez`` writes it),
    never unpickling anything: a file that is not such an archive, or that holds Python objects
    rather than numbers, is a :class:`DictionaryError` saying so."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(8)
        raise DictionaryError(f"{path} is not an npz archive (the zip of .npy arrays numpy.savez writes; it starts "
                              f"with {head!r}); pass the params.npz of a Gemma Scope release, a SAELens folder, "
                              f"or a dict of tensors")
    tensors = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            for key in data.files:
                array = np.asarray(data[key])
                if array.dtype.kind not in "fiu":
                    raise DictionaryError(f"{path}: array {key!r} holds {array.dtype} values, not numbers; a "
                                          f"dictionary's weights are float arrays")
                tensors[_npz_key(key)] = torch.from_numpy(array)
    except DictionaryError:
        raise
    except ValueError as err:  # numpy refuses an object array (it would need unpickling): say what it is
        if "pickle" not in str(err):
            raise DictionaryError(f"{path} is a damaged npz archive ({err})") from None
        raise DictionaryError(f"{path}: an array in it holds Python objects, not numbers; a dictionary's weights "
                              f"are float arrays (write them with numpy.savez of numeric arrays)") from None
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise DictionaryError(f"{path} is a damaged npz archive ({type(err).__name__}: {err}); it is truncated or "
                              f"not what numpy.savez wrote") from None
    return tensors


def _npz_key(key: str) -> str:
    return "W_" + key[2:] if key.startswith("w_") else key


def _site(value, role: str, where: str) -> Address:
    """``value`` (our address or a TransformerLens hook name) as the address a dictionary sits at."""
    try:
        address = hook_address(value) if isinstance(value, str) else Address(*value) if isinstance(
            value, tuple) else value
    except AddressError as err:
        raise DictionaryError(f"{where}: the address it {role}: {err}") from None
    if not isinstance(address, Address) or address.name not in DICTIONARY_SITES:
        raise DictionaryError(f"{where}: a dictionary {role} one vector per position at one of "
                              f"{', '.join(f'{s}.L' for s in DICTIONARY_SITES)}; {value!r} is not one")
    return address


def _from_saelens(path: Path, *, reads, writes, k, norm_scaling_factor, name, dtype, device) -> Dictionary:
    try:
        cfg = json.loads((path / _CFG).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DictionaryError(f"{path / _CFG} is not readable JSON ({err}); it should be the config SAELens "
                              f"wrote beside {_WEIGHTS}") from None
    if not isinstance(cfg, dict):
        raise DictionaryError(f"{path / _CFG} holds {type(cfg).__name__}, not a SAELens config object")
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    version = str(meta.get("sae_lens_version") or cfg.get("sae_lens_version") or "")
    v6 = version[:1].isdigit() and int(version.split(".")[0]) >= 6
    get = (lambda key, default=None: meta.get(key, cfg.get(key, default))) if v6 else (
        lambda key, default=None: cfg.get(key, default))
    tensors = _read_safetensors(path / _WEIGHTS)
    act_fn = cfg.get("activation_fn_str", cfg.get("activation_fn", "relu"))
    kwargs = cfg.get("activation_fn_kwargs") or {}
    architecture = cfg.get("architecture", _architecture_of(tensors, act_fn))
    if not v6 and architecture == "standard" and act_fn == "topk":
        architecture = "topk"
    if architecture not in ARCHITECTURES:
        raise DictionaryError(f"{path}: SAELens architecture {architecture!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)}")
    if not v6 and act_fn not in ("relu", "topk"):
        raise DictionaryError(f"{path}: activation function {act_fn!r} is not supported (relu, topk)")
    activation, transcoder, skip = ARCHITECTURES[architecture]
    if get("hook_head_index") is not None:
        raise DictionaryError(f"{path}: this dictionary reads one head (hook_head_index="
                              f"{get('hook_head_index')}); per-head dictionaries are not supported")
    hook = reads if reads is not None else get("hook_name", cfg.get("hook_point"))
    if hook is None:
        raise DictionaryError(f"{path}: the config names no hook_name; pass reads='resid_post.L' (the address it "
                              f"reads)")
    hook_out = writes if writes is not None else (get("hook_name_out") if transcoder else None)
    if transcoder and hook_out is None:
        raise DictionaryError(f"{path}: a {architecture} predicts another address, but its config names no "
                              f"hook_name_out; pass writes='mlp_out_post.L' (the address it predicts)")
    options = {"activation": activation, "k": None, "norm_scaling_factor": norm_scaling_factor}
    if activation == "topk":
        options["k"] = k if k is not None else cfg.get("k", kwargs.get("k"))
    elif k is not None:
        raise DictionaryError(f"{path}: k={k!r} applies to a topk dictionary, but this one is {architecture!r} "
                              f"(cfg.json); leave k out")
    if architecture == "batchtopk":
        options.update(_batchtopk_threshold(path, tensors))
    _fold_scaling_factor(path, cfg, tensors)
    _check_against_cfg(path, cfg, tensors, architecture, activation, skip)
    normalize = cfg.get("normalize_activations", "none")
    if normalize not in _NORMALIZE:
        raise DictionaryError(f"{path}: normalize_activations={normalize!r} is not supported; supported: none, "
                              f"constant_norm_rescale, layer_norm, expected_average_only_in")
    return _from_tensors(
        tensors, reads=hook, writes=hook_out, normalize=_NORMALIZE[normalize],
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", not transcoder)) and not transcoder,
        rescale_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        name=name or path.name, dtype=dtype if dtype is not None else _dtype(cfg.get("dtype")), device=device,
        where=str(path), skip=skip, **options)


def _architecture_of(tensors: dict, act_fn) -> str:
    """The architecture of a config that names none: JumpReLU where the weights hold a threshold
    (a ReLU would silently drop it), otherwise SAELens's default, standard."""
    return "jumprelu" if act_fn == "relu" and ("threshold" in tensors or "log_threshold" in tensors) else "standard"


def _check_against_cfg(path: Path, cfg: dict, tensors: dict, architecture: str, activation: str, skip: bool) -> None:
    """The config and the weights must describe the same dictionary (SAELens refuses a folder
    where they do not): every tensor is one the architecture uses, and the widths the config
    gives are the weights' own."""
    expected = {"W_enc", "b_enc", "W_dec", "b_dec"} | ({"threshold", "log_threshold"} if activation == "jumprelu"
                                                       else set()) | ({"W_skip"} if skip else set())
    extra = sorted(set(tensors) - expected)
    if extra:
        hint = (f"; a threshold belongs to a JumpReLU dictionary: if it is one, set \"architecture\": \"jumprelu\" "
                f"in {_CFG}" if {"threshold", "log_threshold"} & set(extra) else "")
        raise DictionaryError(f"{path}: the weights hold {extra}, which a {architecture!r} dictionary (as {_CFG} "
                              f"says) does not use{hint}; the config and {_WEIGHTS} disagree")
    w_enc, w_dec = tensors.get("W_enc"), tensors.get("W_dec")
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in (w_enc, w_dec)):
        return  # the Dictionary's own check says what is wrong with them
    for key, actual, what in (("d_in", w_enc.shape[0], "W_enc's rows"), ("d_sae", w_enc.shape[1], "W_enc's columns"),
                              ("d_out", w_dec.shape[1], "W_dec's columns")):
        given = cfg.get(key)
        if given is not None and (isinstance(given, bool) or given != actual):
            raise DictionaryError(f"{path}: {_CFG} says {key}={given!r}, but the weights have {actual} ({what}: "
                                  f"W_enc {list(w_enc.shape)}, W_dec {list(w_dec.shape)}); the config and "
                                  f"{_WEIGHTS} disagree: fix {key} in {_CFG} or use the weights it was written for")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise DictionaryError(f"{path.parent}: {path.name} is missing; a SAELens folder holds cfg.json and {_WEIGHTS}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise DictionaryError(f"{path} cannot be read as safetensors ({err}); it is damaged or truncated") from None


def _batchtopk_threshold(path: Path, tensors: dict) -> dict:
    """A BatchTopK training checkpoint runs as JumpReLU at its learnt threshold (what SAELens
    saves for inference): a per-token rule, so a token's features never depend on its batch."""
    learnt = tensors.pop("topk_threshold", None)
    if "threshold" in tensors:
        return {}
    if learnt is None:
        raise DictionaryError(f"{path}: a batchtopk checkpoint needs its learnt 'topk_threshold' (or a "
                              f"'threshold'); BatchTopK itself depends on the whole batch, which a per-request "
                              f"engine never sees. Save it with SAELens's save_inference_model")
    tensors["threshold"] = torch.full_like(tensors["b_enc"], float(learnt))
    return {"activation": "jumprelu"}


def _fold_scaling_factor(path: Path, cfg: dict, tensors: dict) -> None:
    """SAELens before 6 multiplied the features by a finetuning scaling factor before decoding;
    the same maths is the decoder's rows scaled by it (the features reported are unscaled)."""
    for key in ("finetuning_scaling_factor", "scaling_factor"):
        factor = tensors.pop(key, None)
        if factor is None or bool(torch.all(factor == 1)):
            continue
        if not cfg.get("finetuning_scaling_factor", False):
            raise DictionaryError(f"{path}: the weights hold a {key} that is not all ones, but the config's "
                                  f"finetuning_scaling_factor is false; the file is inconsistent")
        tensors["W_dec"] = tensors["W_dec"] * factor.to(tensors["W_dec"].dtype)[:, None]


def _dtype(name):
    if name is None:
        return None
    text = str(name).removeprefix("torch.")
    try:
        return to_dtype(text)
    except (KeyError, ValueError, TypeError):
        raise DictionaryError(f"dtype {name!r} is not one of float32, float16, bfloat16") from None


def _from_tensors(tensors: dict, *, reads, writes=None, activation=None, k=None, norm_scaling_factor=None,
                  apply_b_dec_to_input=None, normalize="none", rescale_by_decoder_norm=False, name=None,
                  dtype=None, device=None, where="dictionary", skip=None) -> Dictionary:
    if reads is None:
        raise DictionaryError(f"{where}: pass reads= (the address it encodes, e.g. 'resid_post.3' or "
                              f"'blocks.3.hook_resid_post'); the weights alone do not say")
    missing = [key for key in ("W_enc", "b_enc", "W_dec", "b_dec") if key not in tensors]
    if missing:
        raise DictionaryError(f"{where}: missing tensors {missing}; a dictionary holds W_enc [d_in, d_sae], b_enc, "
                              f"W_dec [d_sae, d_out], b_dec (and threshold for JumpReLU); it holds "
                              f"{sorted(tensors)}")
    t = {key: torch.as_tensor(value) for key, value in tensors.items()}
    if "threshold" not in t and "log_threshold" in t:
        t["threshold"] = t["log_threshold"].exp()
    if activation is None:
        activation = "topk" if k is not None else "jumprelu" if "threshold" in t else "relu"
    if skip is False and "W_skip" in t:
        raise DictionaryError(f"{where}: the weights hold W_skip, but the architecture has no skip connection")
    if skip and "W_skip" not in t:
        raise DictionaryError(f"{where}: a skip transcoder needs W_skip [d_out, d_in]; the weights hold "
                              f"{sorted(t)}")
    if normalize == "scale" or norm_scaling_factor is not None:
        if norm_scaling_factor is None:
            raise DictionaryError(f"{where}: this dictionary was trained on activations scaled by a constant "
                                  f"(expected_average_only_in), which its folder does not hold; pass "
                                  f"norm_scaling_factor= (from its release), or norm_scaling_factor=1.0 if the "
                                  f"factor is already folded into the weights")
        normalize = "scale"
    reads_at = _site(reads, "reads", where)
    writes_at = None if writes is None else _site(writes, "writes", where)
    target = dtype if dtype is not None else t["W_enc"].dtype
    if not isinstance(target, torch.dtype):
        target = _dtype(target)

    def put(key):
        return None if key not in t else t[key].detach().to(device=device or "cpu", dtype=target).contiguous()

    return Dictionary(
        W_enc=put("W_enc"), b_enc=put("b_enc"), W_dec=put("W_dec"), b_dec=put("b_dec"), reads=reads_at,
        writes=writes_at, activation=activation, threshold=put("threshold"),
        k=k, apply_b_dec_to_input=bool(apply_b_dec_to_input), normalize=normalize, norm_scale=norm_scaling_factor,
        rescale_by_decoder_norm=rescale_by_decoder_norm, W_skip=put("W_skip"), name=name or "")


assert set(DICTIONARY_SITES) <= set(SITES)


def save_dictionary(dictionary: Dictionary, folder) -> Path:
    """Write ``dictionary`` as a SAELens 6 folder (``cfg.json`` + ``sae_weights.safetensors``) that
    SAELens's ``SAE.load_from_disk`` and :func:`load_dictionary` both read back with the same maths
    (a ``scale`` normalisation is folded into the weights, which is what it means). Returns the folder."""
    from safetensors.torch import save_file

    d = dictionary
    if d.is_transcoder and d.activation == "topk":
        raise DictionaryError(f"{d!r}: SAELens has no TopK transcoder to save it as")
    tensors = {n: getattr(d, n).detach().cpu().contiguous() for n in ("W_enc", "b_enc", "W_dec", "b_dec")}
    normalize = d.normalize
    if normalize == "scale":  # x * s in, / s out: the same maths with the factor in the weights
        s = d.norm_scale
        tensors.update(W_enc=tensors["W_enc"] * s, W_dec=tensors["W_dec"] / s, b_dec=tensors["b_dec"] / s)
        normalize = "none"
    if d.threshold is not None:
        tensors["threshold"] = d.threshold.detach().cpu().contiguous()
    if d.W_skip is not None:
        tensors["W_skip"] = d.W_skip.detach().cpu().contiguous()
    kind = {"relu": "standard", "jumprelu": "jumprelu", "topk": "topk"}[d.activation]
    if d.is_transcoder:
        kind = ("jumprelu_" if d.activation == "jumprelu" else "") + ("skip_transcoder" if d.W_skip is not None
                                                                      else "transcoder")
    metadata = {"sae_lens_version": "6.0.0", "hook_name": hook_name(d.reads)}
    if d.is_transcoder:
        metadata["hook_name_out"] = hook_name(d.writes)
    cfg = {"d_in": d.d_in, "d_sae": d.d_sae, "dtype": str(d.dtype).removeprefix("torch."), "device": "cpu",
           "apply_b_dec_to_input": d.apply_b_dec_to_input, "normalize_activations": normalize,
           "reshape_activations": "hook_z" if d.reads.name == "z" else "none", "metadata": metadata,
           "architecture": kind}
    if d.is_transcoder:
        cfg["d_out"] = d.d_out
    if d.activation == "topk":
        cfg.update(k=d.k, rescale_acts_by_decoder_norm=d.rescale_by_decoder_norm)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / _WEIGHTS))
    (folder / _CFG).write_text(json.dumps(cfg, indent=1))
    return folder
