"""Peers side by side: one capture workload through interp_engine, TransformerLens and nnsight.

SmolLM2-135M (the embedded model, fp32, CPU), a batch of 8 x 128 random token ids (seed 0),
two workloads: ``resid_post`` at every layer (30 points), and ``resid_post`` + ``z`` +
``mlp_out`` at every layer (90 points). Each tool loads its own copy of the same weights (the
embedded model's HF folder) and runs the workload its own way:

- interp_engine eager: ``run_with_cache(model, ids, points)``;
- TransformerLens 4 (``TransformerBridge.boot_transformers``): ``bridge.run_with_cache(ids,
  names_filter=[...])`` with the bridge's hook names (``blocks.L.hook_resid_post``,
  ``blocks.L.attn.hook_z``, ``blocks.L.hook_mlp_out``);
- nnsight 0.8 (``TransformersModel`` around an HF model): one ``trace(ids)`` that calls
  ``.save()`` on the decoder layer's output, ``self_attn.o_proj``'s input (z) and ``mlp``'s
  output.

Each tool also runs its own plain forward, with no capture: the HF model (``sdpa`` attention)
for interp_engine, ``bridge(ids)`` for TransformerLens (the bridge forces eager attention), and
the HF model that nnsight wraps, called outside a trace. The HF plain forward of interp_engine
is the common baseline (``hf``); ``hf_last`` is the same with ``logits_to_keep=1``, the work of
an interp_engine capture that does not ask for logits; ``hf_eager`` is the same with eager
attention, the attention the bridge runs. Every call runs under ``torch.no_grad``
with the same torch thread count, all in this one process. Each repetition runs every variant
once: tool after tool, each tool's variants one after another (its plain forward among them),
tools and variants in an order shuffled anew each repetition (see ``timing.py``). Before timing, each peer's captures are checked against
interp_engine's (relative error <= 1e-4 at three layers per site), so no variant measures a
no-op.

The peers are an optional extra, installed in their own venv (``make bench`` builds
``.venv-bench``): TransformerLens 4 replaces the transformer-lens<4 that sae-lens, a test oracle,
needs, so it must stay out of the test venv:

    make .venv-bench/.installed
    .venv-bench/bin/python bench/peers.py [--reps 5] [--warmup 1] [--threads N] [--only tl nn]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os

import torch
import transformers
from timing import alternate, fastest, median, paired  # bench/timing.py, beside this file

from interp_engine import Address, embedded, load_model, relative_error, run_with_cache
from interp_engine.backends.eager import attention

WORKLOADS = {"resid_post": ("resid_post",), "three": ("resid_post", "z", "mlp_out")}
# Within a layer, the order the forward computes the sites; nnsight reads modules in that order.
EXECUTION_ORDER = ("z", "mlp_out", "resid_post")
TOLERANCE = 1e-4

TL_HOOK = {"resid_post": "blocks.{}.hook_resid_post", "z": "blocks.{}.attn.hook_z",
           "mlp_out": "blocks.{}.hook_mlp_out"}
# (module under the decoder layer, "input" or "output")
NN_PATH = {"resid_post": ("", "output"), "z": ("self_attn.o_proj", "input"), "mlp_out": ("mlp", "output")}

PEERS = {"tl": ("transformer-lens", "TransformerLens bridge"), "nn": ("nnsight", "nnsight trace")}


def points_of(workload: str, n_layers: int) -> list[tuple[str, int]]:
    sites = WORKLOADS[workload]
    return [(s, layer) for layer in range(n_layers) for s in EXECUTION_ORDER if s in sites]


def interp_engine_tool(path: str):
    model = load_model(path)

    def plain(ids, implementation="sdpa", **kwargs):
        with attention.using(model.hf, implementation):
            return model.hf(input_ids=ids, **kwargs).logits

    def capture(ids, points):
        cache = run_with_cache(model, ids, [Address(s, layer) for s, layer in points])
        return {(s, layer): cache[Address(s, layer)] for s, layer in points}

    return model, plain, capture


def transformer_lens_tool(path: str):
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(path, device="cpu", dtype=torch.float32)

    def capture(ids, points):
        names = {TL_HOOK[s].format(layer): (s, layer) for s, layer in points}
        _, cache = bridge.run_with_cache(ids, names_filter=list(names))
        return {key: cache[name] for name, key in names.items()}

    return bridge, capture


def nnsight_tool(path: str):
    from nnsight.modeling.transformers import TransformersModel

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lm = TransformersModel(hf, task="text-generation")

    def plain(ids):
        return hf(input_ids=ids).logits

    def capture(ids, points):
        saved = {}
        with lm.trace(ids):
            for site, layer in points:
                module, end = NN_PATH[site]
                envoy = functools.reduce(getattr, module.split(".") if module else [], lm.model.layers[layer])
                saved[site, layer] = getattr(envoy, end).save()
        return saved

    return plain, capture


def without_grad(fn):
    def run():
        with torch.no_grad():
            return fn()

    return run


def check(name: str, got: dict, want: dict, n_layers: int) -> None:
    """Each site at the first, middle and last layer within TOLERANCE of interp_engine's."""
    assert got.keys() == want.keys(), f"{name}: captured {len(got)} points, want {len(want)}"
    for (site, layer), w in want.items():
        if layer not in (0, n_layers // 2, n_layers - 1):
            continue
        g = got[site, layer]
        g, w = g.reshape(*w.shape[:2], -1), w.reshape(*w.shape[:2], -1)
        err = relative_error(g, w)
        assert err <= TOLERANCE, f"{name}: {site}.{layer} differs from interp_engine's by {err:.2e}"
    print(f"  {name}: {len(got)} points; every site at layers 0, {n_layers // 2}, {n_layers - 1} "
          f"within {TOLERANCE:g} of interp_engine's")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of every variant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--only", nargs="*", choices=list(PEERS), default=list(PEERS), help="peers to run")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for key in args.only:
        package = PEERS[key][0]
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{package} is not installed; the peers are the optional `bench` extra: "
                             "make .venv-bench/.installed (their own venv, never the test venv's)") from None

    path = str(embedded.ensure())
    model, hf_plain, ie_capture = interp_engine_tool(path)
    n_layers = model.n_layers
    # Ordinary ids (no specials): 3 .. vocab, as in eager_capture.py.
    ids = torch.randint(3, model.info.d_vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    points = {w: points_of(w, n_layers) for w in WORKLOADS}

    runs = {"hf": lambda: hf_plain(ids), "hf_last": lambda: hf_plain(ids, logits_to_keep=1),
            "hf_eager": lambda: hf_plain(ids, "eager")}
    captures = {"ie": ie_capture}
    if "tl" in args.only:
        bridge, captures["tl"] = transformer_lens_tool(path)
        runs["tl/plain"] = lambda: bridge(ids)
    if "nn" in args.only:
        nn_plain, captures["nn"] = nnsight_tool(path)
        runs["nn/plain"] = lambda: nn_plain(ids)
    for tool, capture in captures.items():
        for w in WORKLOADS:
            runs[f"{tool}/{w}"] = functools.partial(capture, ids, points[w])
    runs = {name: without_grad(fn) for name, fn in runs.items()}

    print("checking the captures against interp_engine's:")
    want = runs["ie/three"]()
    for tool in captures:
        if tool != "ie":
            check(tool, runs[f"{tool}/three"](), want, n_layers)
    del want

    versions = ", ".join(f"{p} {importlib.metadata.version(p)}"
                         for p in ["torch", "transformers"] + [PEERS[k][0] for k in args.only])
    print(f"\n{embedded.NAME} fp32: batch {args.batch} x {args.seq} tokens, {torch.get_num_threads()} torch "
          f"threads, {args.reps} reps (+{args.warmup} warm-up); {versions}; load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    groups = [[name for name in runs if name.startswith(f"{tool}/") or (tool == "ie" and name.startswith("hf"))]
              for tool in captures]
    wall, cpu = alternate(runs, args.reps, args.warmup, groups=groups)
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    report(wall, cpu, captures)


def report(wall, cpu, captures) -> None:
    own = {"ie": "hf", "tl": "tl/plain", "nn": "nn/plain"}
    label = {"ie": "interp_engine", **{k: v[1] for k, v in PEERS.items()}}
    print("\npaired: the median of the per-repetition ratios; min: the ratio of the fastest repetitions")
    print("| tool | variant | CPU median s | CPU paired / own plain | CPU paired / HF plain | CPU min / own plain "
          "| CPU min / HF plain | wall paired / own plain | wall paired / HF plain |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def row(tool, name, base):
        print(f"| {label[tool]} | `{name}` | {median(cpu[name]):.3f} | {paired(cpu, name, base):.3f}x "
              f"| {paired(cpu, name, 'hf'):.3f}x | {fastest(cpu, name, base):.3f}x | {fastest(cpu, name, 'hf'):.3f}x "
              f"| {paired(wall, name, base):.3f}x | {paired(wall, name, 'hf'):.3f}x |")

    row("ie", "hf", "hf")
    row("ie", "hf_last", "hf")
    row("ie", "hf_eager", "hf")
    for tool in captures:
        if tool != "ie":
            row(tool, own[tool], own[tool])
        for w in WORKLOADS:
            row(tool, f"{tool}/{w}", own[tool])
    if "tl" in captures:
        print(f"TransformerLens bridge plain / HF plain with eager attention: CPU paired "
              f"{paired(cpu, 'tl/plain', 'hf_eager'):.3f}x, CPU min {fastest(cpu, 'tl/plain', 'hf_eager'):.3f}x")
    print(f"interp_engine resid_post / HF plain with logits_to_keep=1: CPU paired "
          f"{paired(cpu, 'ie/resid_post', 'hf_last'):.3f}x, CPU min {fastest(cpu, 'ie/resid_post', 'hf_last'):.3f}x")


if __name__ == "__main__":
    main()
