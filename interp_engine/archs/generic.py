"""The generic path: a family record found on the model itself, for a model no record names.

Most decoder-only families in transformers are built the same way: a ``ModuleList`` of decoder
layers, a final norm and an unembedding; inside a layer an attention module ending in an output
projection and an MLP ending in a down projection. :func:`discover` finds those modules by their
usual names and then *proves* what each one means on a probe forward at load time, serving a
site only where the proof holds:

- ``resid_pre`` / ``resid_post`` / ``resid_streams``: the layers' inputs and outputs, if each
  layer's output is the next one's input and each input is the model's own hidden state
  (``output_hidden_states``); ``logits``: the final norm and the unembedding, if they give the
  model's logits from the last layer's output (that also proves the logit lens);
- ``attn_out`` / ``mlp_out``: the attention and MLP outputs, if ``resid_post = resid_pre +
  attn_out + mlp_out`` at every layer (true of sequential and parallel blocks alike);
- ``resid_mid``: the input of the module of the layer that reads ``resid_pre + attn_out`` (a
  sequential block's pre-MLP norm); a parallel block has none, and the refusal says so;
- ``z`` / ``mlp_post``: the inputs of the output and down projections, if each projection's output
  is its block's output and its input has the width of ``n_heads * d_head`` / ``d_mlp``.

``q``, ``k``, ``v`` and ``pattern`` are refused: where a family applies rotary embeddings and
qk-norms, and how it lays out its heads, is not something a probe can establish. A family with a
record always takes its record; this path is for the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compare import relative_error
from ..errors import UnsupportedModel
from .base import Arch, Hook

ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")
O_PROJ_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "wo")
DOWN_NAMES = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2", "wo")

NO_ATTENTION_INTERNALS = (
    "the generic path serves no q, k, v or pattern: where this family applies rotary embeddings and qk-norms, "
    "and how it lays out its heads, cannot be proven on a probe; add a family record in interp_engine/archs/"
)

NO_PRE_GAIN = ("the generic path serves no norm's output before its gain: how an unknown family's norm splits into "
               "normalisation and gain cannot be proven on a probe (final_norm, after the gain, is served)")

#: config names of the MLP width across families (GPT-BigCode: ``n_inner``, else 4 * d_model); the
#: width is then proven on the down projection, so a wrong guess refuses mlp_post, never misreads it
GENERIC_DIMS = dict(d_mlp_from=("intermediate_size", "n_inner", "ffn_dim", "d_ff"), d_mlp_ratio=4)

#: the probe's length, in tokens
PROBE_TOKENS = 8


def _refuse(hf, problem: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"{problem}. model_type {getattr(hf.config, 'model_type', '?')!r} has no family record, and the generic path "
        f"serves only models it can prove the layout of; add a family record in interp_engine/archs/")


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 or dtype == torch.float64 else 2e-2


def _path_of(model, target) -> str | None:
    return next((name for name, m in model.named_modules() if m is target), None)


def _child(module, names) -> str | None:
    children = dict(module.named_children())
    return next((n for n in names if n in children), None)


def _layers(hf) -> str:
    n = hf.config.num_hidden_layers
    found = [name for name, m in hf.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n
             and len({type(layer) for layer in m}) == 1]
    if not found:
        raise _refuse(hf, f"no ModuleList of {n} decoder layers (config.num_hidden_layers) found in "
                          f"{type(hf).__name__}")
    return min(found, key=lambda p: p.count("."))


def _output(value):
    return value[0] if isinstance(value, (tuple, list)) else value


class _Probe:
    """Hooks that keep the input or output of modules during one forward."""

    def __init__(self):
        self.seen: dict[tuple[str, str], torch.Tensor] = {}
        self.handles = []

    def watch(self, module, key: str, phase: str):
        if phase == "in":
            def hook(mod, args, kwargs):
                value = args[0] if args else kwargs.get("hidden_states")
                if isinstance(value, torch.Tensor):
                    self.seen[(key, "in")] = value.detach().clone()
            self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            def hook(mod, args, output):
                value = _output(output)
                if isinstance(value, torch.Tensor):
                    self.seen[(key, "out")] = value.detach().clone()
            self.handles.append(module.register_forward_hook(hook))

    def get(self, key: str, phase: str):
        return self.seen.get((key, phase))

    def close(self):
        for handle in self.handles:
            handle.remove()


def discover(hf) -> Arch:
    """A family record for the Hugging Face causal LM ``hf``, every site proven on a probe forward
    (see the module docstring); :class:`UnsupportedModel` if its layers, final norm or unembedding
    cannot be found or do not behave as such."""
    config = hf.config
    model_type = getattr(config, "model_type", "?")
    layers_path = _layers(hf)
    stack_path = layers_path.rpartition(".")[0]
    stack = hf.get_submodule(stack_path) if stack_path else hf
    layers = hf.get_submodule(layers_path)
    unembed = _path_of(hf, hf.get_output_embeddings())
    embed = _path_of(hf, hf.get_input_embeddings())
    if unembed is None or embed is None:
        raise _refuse(hf, f"{type(hf).__name__} has no output or input embedding module to unembed with")
    norms = [f"{stack_path}.{n}" if stack_path else n for n, m in stack.named_children()
             if "norm" in n.lower() or "ln" in n.lower() or "norm" in type(m).__name__.lower()]
    first = layers[0]
    attn = _child(first, ATTENTION_NAMES)
    mlp = _child(first, MLP_NAMES)
    o_proj = attn and _child(first.get_submodule(attn), O_PROJ_NAMES)
    down = mlp and _child(first.get_submodule(mlp), DOWN_NAMES)
    children = [n for n, _ in first.named_children() if n not in (attn, mlp)]

    probe = _Probe()
    try:
        for i, layer in enumerate(layers):
            probe.watch(layer, f"{i}", "in")
            probe.watch(layer, f"{i}", "out")
            for name in filter(None, [attn, mlp, *children]):
                probe.watch(layer.get_submodule(name), f"{i}.{name}", "in" if name in children else "out")
            for sub in filter(None, [attn and o_proj and f"{attn}.{o_proj}", mlp and down and f"{mlp}.{down}"]):
                probe.watch(layer.get_submodule(sub), f"{i}.{sub}", "in")
                probe.watch(layer.get_submodule(sub), f"{i}.{sub}", "out")
        ids = torch.randint(config.vocab_size, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
        device = next(hf.parameters()).device
        with torch.no_grad():
            out = hf(input_ids=ids.to(device), use_cache=False, output_hidden_states=True)
    finally:
        probe.close()
    with torch.no_grad():
        return _prove(hf, model_type, probe, out, dict(
            layers=layers_path, embed=embed, unembed=unembed, norms=norms, attn=attn, mlp=mlp, o_proj=o_proj,
            down=down, children=children))


def _near(a, b, tol) -> bool:
    return a is not None and b is not None and a.shape == b.shape and relative_error(a, b) <= tol


def _prove(hf, model_type: str, probe: _Probe, out, found: dict) -> Arch:
    config = hf.config
    n = config.num_hidden_layers
    tol = _tolerance(next(hf.parameters()).dtype)
    pre = [probe.get(f"{i}", "in") for i in range(n)]
    post = [probe.get(f"{i}", "out") for i in range(n)]
    hidden = getattr(out, "hidden_states", None)
    chained = all(_near(post[i], pre[i + 1], tol) for i in range(n - 1)) and all(p is not None for p in pre + post)
    if hidden is not None:
        chained = chained and all(_near(pre[i], hidden[i], tol) for i in range(n))
    if not chained:
        raise _refuse(hf, f"the layers at {found['layers']} do not pass one residual stream from each to the next "
                          f"(a layer's output is not the next one's input, or not the model's hidden state)")
    final_norm = next((p for p in found["norms"] if _unembeds(hf, p, found["unembed"], post[-1], out.logits, tol)),
                      None)
    if final_norm is None:
        raise _refuse(hf, f"no final norm among {found['norms'] or 'the modules beside the layers'} gives the "
                          f"model's logits from the last layer's output through {found['unembed']}")
    sites = {"resid_pre": Hook("", "in"), "resid_post": Hook("", "out"), "resid_streams": Hook("", "out")}
    refused = {name: NO_ATTENTION_INTERNALS for name in ("q", "k", "v", "pattern", "attn_scores")}
    attn, mlp = found["attn"], found["mlp"]
    a_out = [probe.get(f"{i}.{attn}", "out") for i in range(n)] if attn else None
    m_out = [probe.get(f"{i}.{mlp}", "out") for i in range(n)] if mlp else None
    blocks = bool(a_out and m_out) and all(
        a_out[i] is not None and m_out[i] is not None and _near(pre[i] + a_out[i] + m_out[i], post[i], tol)
        for i in range(n))
    if not blocks:
        why = (f"no attention module ({'/'.join(ATTENTION_NAMES)}) and MLP ({'/'.join(MLP_NAMES)}) found in the layer"
               if not (attn and mlp) else
               f"resid_post != resid_pre + {attn} output + {mlp} output on the probe: the blocks' outputs are not "
               f"what the layer adds (a norm or scale after them?)")
        refused.update({s: why for s in ("attn_out", "mlp_out", "resid_mid", "z", "mlp_post")})
        return _record(model_type, found, final_norm, sites, refused, "out_in")
    sites.update(attn_out=Hook(attn, "out"), mlp_out=Hook(mlp, "out"))
    mid = next((c for c in found["children"]
                if all(_near(probe.get(f"{i}.{c}", "in"), pre[i] + a_out[i], tol) for i in range(n))), None)
    if mid is not None:
        sites["resid_mid"] = Hook(mid, "in")
    else:
        refused["resid_mid"] = ("no module of the layer reads resid_pre + attn_out: attention and the MLP both read "
                                "resid_pre (a parallel block), so no residual stream exists between them; "
                                "resid_post = resid_pre + attn_out + mlp_out")
    weights = "out_in"
    info = _dims(config)
    if found["o_proj"]:
        z_path = f"{attn}.{found['o_proj']}"
        layout = _layout(hf, found["layers"], z_path, probe, a_out, n, tol, info["n_heads"] * info["d_head"])
        if layout:
            sites["z"], weights = Hook(z_path, "in"), layout
    if "z" not in sites:
        refused["z"] = (f"no output projection ({'/'.join(O_PROJ_NAMES)}) of width n_heads * d_head whose output is "
                        f"the attention block's was found under {attn}")
    if found["down"]:
        down = f"{mlp}.{found['down']}"
        if all(_near(probe.get(f"{i}.{down}", "out"), m_out[i], tol) and probe.get(f"{i}.{down}", "in").shape[-1]
               == info["d_mlp"] for i in range(n)):
            sites["mlp_post"] = Hook(down, "in")
    if "mlp_post" not in sites:
        refused["mlp_post"] = (f"no down projection ({'/'.join(DOWN_NAMES)}) of width d_mlp whose output is the MLP "
                               f"block's was found under {mlp}")
    return _record(model_type, found, final_norm, sites, refused, weights)


def _unembeds(hf, norm: str, unembed: str, last: torch.Tensor, logits: torch.Tensor, tol: float) -> bool:
    """Whether ``unembed(norm(last))`` is the model's ``logits``."""
    try:
        return _near(hf.get_submodule(unembed)(hf.get_submodule(norm)(last)), logits, tol)
    except (TypeError, RuntimeError, ValueError):  # not a norm: it takes other arguments or shapes
        return False


def _dims(config) -> dict:
    """n_heads, and d_mlp / d_head / n_kv_heads under the usual config names (the generic record's)."""
    return {"n_heads": config.num_attention_heads, **Arch("generic", (), {}, **GENERIC_DIMS).dims(config)}


def _layout(hf, layers: str, path: str, probe: _Probe, a_out, n: int, tol: float, width: int) -> str | None:
    """How the projection at ``path`` stores its weight (``out_in`` / ``in_out``), proven by
    recomputing its output from its input at every layer; None where neither does or the
    projection's output is not the attention block's."""
    for layout in ("out_in", "in_out"):
        ok = True
        for i in range(n):
            proj = hf.get_submodule(layers)[i].get_submodule(path)
            z, got = probe.get(f"{i}.{path}", "in"), probe.get(f"{i}.{path}", "out")
            weight = getattr(proj, "weight", None)
            if z is None or weight is None or weight.dim() != 2 or z.shape[-1] != width or not _near(got, a_out[i], tol):
                return None
            w = weight if layout == "out_in" else weight.t()
            if w.shape[1] != width or not _near(F.linear(z, w, getattr(proj, "bias", None)), got, tol):
                ok = False
                break
        if ok:
            return layout
    return None


def _record(model_type: str, found: dict, final_norm: str, sites: dict, refused: dict, weights: str) -> Arch:
    attn = found["attn"] or ""
    refused = {**refused, "ln_final_normalized": NO_PRE_GAIN}
    return Arch(f"generic ({model_type})", (model_type,), sites, layers=found["layers"], final_norm=final_norm,
                unembed=found["unembed"], embed=found["embed"], attention=attn,
                o_proj=sites["z"].module if "z" in sites else "", weights=weights, refused=refused, generic=True,
                **GENERIC_DIMS)
