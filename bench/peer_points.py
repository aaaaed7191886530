"""Point by point against the peer: every name both engines serve gives the same tensor.

decoderesearch's ``interp-engine`` (PyPI, the engine behind Neuronpedia) speaks the vocabulary
this project's address space grew from. This script saves the tiny random checkpoints the tests
build (tests/tiny*.py: every family, fixed seed, byte tokenizer) as Hugging Face folders, runs the
peer on each in the peer's **own** virtual environment (it imports as ``interp_engine`` too, so it
never shares ours: bench/peer_side.py runs there and hands its tensors back as safetensors files),
then runs ours (``load_model(folder, backend="eager")``) on the same token rows and compares,
per family and point name over every layer both serve, with :func:`interp_engine.relative_error`.

Each peer point ends as one of:

- ``agrees``: the same tensor within ``--tolerance`` (1e-5 relative) at every layer;
- ``deliberate``: the two engines define the name differently on purpose, as :data:`DELIBERATE`
  says and why (where a peer tensor is ours under another name, that is checked too);
- ``DIFFERS`` / ``STALE``: a shared name that differs without a reason in the table, or a listed
  difference that no longer differs (the table must be mended): the run exits 1;
- ``not served by us`` (the peer serves it, this model here does not) and, listed per family,
  the names we serve and the peer does not.

Names that differ only in spelling are mapped (:data:`ALIASES`); layouts that differ only in
shape (``z``, ``value``: the peer's heads flat) are compared reshaped. Not part of ``make test``:

    .venv/bin/python bench/peer_points.py [--peer-venv DIR] [--families llama gpt2 ...]

The first run creates the peer's venv at ``--peer-venv`` (outside any checkout) with
``pip install`` of :data:`PEER_PACKAGES`. The last run's output is in docs/PEER.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_SIDE = Path(__file__).resolve().with_name("peer_side.py")
PEER_PACKAGES = ("torch==2.13.0", "transformers==5.19.0", "interp-engine==1.14.2")
DEFAULT_VENV = Path.home() / ".cache" / "interp_engine" / "peer-venv-1.14.2"
TOLERANCE = 1e-5

#: the peer's name -> ours, where only the spelling differs (the same tensor)
ALIASES = {
    "attn_probs": "pattern",
    "mlp_act": "mlp_post",
    "value": "v",
    "lm_head": "logits",
    "embeddings": "resid_pre",  # at layer 0 (the peer's is model-level)
    "q_norm_out": "q",  # the closest we serve: a deliberate difference (rotary)
    "k_norm_out": "k",
}


@dataclasses.dataclass(frozen=True)
class Context:
    """What a deliberate difference's predicates read: the family's config, the peer's tensors
    (address string -> tensor) and the peer address being compared."""

    config: dict
    peer: dict
    address: str


def _layer_twin(name: str) -> Callable[[Context], object]:
    """The peer tensor at the same layer under ``name``."""
    return lambda ctx: ctx.peer.get(name + ctx.address[ctx.address.index("."):])


def _differs(a, b) -> bool:
    from interp_engine import relative_error

    return a is not None and b is not None and relative_error(a, b) > TOLERANCE


def _softcapped(ctx: Context):
    cap = ctx.config["final_logit_softcapping"]
    return cap * (ctx.peer[ctx.address] / cap).tanh()


@dataclasses.dataclass(frozen=True)
class Deliberate:
    """One name both engines use for different tensors, on purpose: where ``applies``, ours may
    differ from the peer's; ``ours_is`` (optional) is the peer-side tensor ours must equal there."""

    name: str
    why: str
    applies: Callable[[Context], bool]
    ours_is: Callable[[Context], object] | None = None
    ours_is_called: str = ""


#: The known definitional differences (DESIGN.md §9, issue 37). A listed difference that stops
#: differing fails the run as STALE, so this table cannot outlive the code it describes.
DELIBERATE = (
    Deliberate("attn_out", "the peer's attn_out is the attention block's raw output; ours is what the block adds "
               "to the residual, after the post-attention norm (sandwich-norm families)",
               applies=lambda ctx: _differs(ctx.peer[ctx.address], _layer_twin("attn_out_post")(ctx)),
               ours_is=_layer_twin("attn_out_post"), ours_is_called="the peer's attn_out_post"),
    Deliberate("mlp_out", "the peer's mlp_out is the MLP block's raw output; ours is what the block adds to the "
               "residual, after the post-feedforward norm (sandwich-norm families)",
               applies=lambda ctx: _differs(ctx.peer[ctx.address], _layer_twin("mlp_out_post")(ctx)),
               ours_is=_layer_twin("mlp_out_post"), ours_is_called="the peer's mlp_out_post"),
    Deliberate("lm_head", "the peer's lm_head is the unembedding's output before the final logit softcap; our "
               "logits are the model's output, after it",
               applies=lambda ctx: bool(ctx.config.get("final_logit_softcapping")),
               ours_is=_softcapped, ours_is_called="cap·tanh(the peer's lm_head / cap)"),
    Deliberate("embeddings", "the peer's embeddings is the token embedding alone; our resid_pre.0 is the residual "
               "entering layer 0, with the learned position embeddings added",
               applies=lambda ctx: ctx.config.get("model_type") == "gpt2"),
    Deliberate("q_norm_out", "the peer's q_norm_out is the query after its qk-norm and before rotary; our q is "
               "after rotary (the query the scores are taken from)", applies=lambda ctx: True),
    Deliberate("k_norm_out", "the peer's k_norm_out is the key after its qk-norm and before rotary; our k is after "
               "rotary (the key the scores are taken from)", applies=lambda ctx: True),
)
DELIBERATE_BY_NAME = {d.name: d for d in DELIBERATE}


def our_address(peer_address: str, our_sites) -> tuple[str, int | None] | None:
    """Our (site, layer) for a peer address string, or None when we have no such name."""
    name, _, layer = peer_address.partition(".")
    ours = name if name in our_sites else ALIASES.get(name)
    if ours is None or ours not in our_sites:
        return None
    if name == "embeddings":
        return ours, 0
    return ours, int(layer) if layer else None


# --- the families, the tokens and the exchange files ----------------------------------------------


def families() -> dict[str, Callable[[Path], Path]]:
    """family name -> builder(root) -> checkpoint folder: every tiny model the tests use."""
    sys.path.insert(0, str(ROOT))
    from tests import tiny, tiny_gpt, tiny_moe, tiny_recent

    out = {f: (lambda root, f=f: tiny.build(f, root)) for f in tiny.DENSE_FAMILIES}
    out.update({f: (lambda root, f=f: tiny_gpt.build(f, root)) for f in tiny_gpt.configs()})
    for f in dict.fromkeys(tiny_moe.MOE_FAMILIES + tiny_moe.STREAM_FAMILIES):
        out[f] = lambda root, f=f: tiny_moe.build(f, root)
    out.update({f: (lambda root, f=f: tiny_recent.build(f, root)) for f in tiny_recent.FAMILIES})
    return out


def token_rows() -> list[list[int]]:
    """Two rows of 20 byte tokens after BOS (longer than every tiny model's sliding window)."""
    texts = ("The quick brown fox j", "Pack my box with five")
    return [[256] + list(t.encode())[:20] for t in texts]


@dataclasses.dataclass(frozen=True)
class PeerResult:
    """One exchange file of bench/peer_side.py (its ``write_result``), read back."""

    tensors: dict
    refused: dict
    error: str
    version: str
    order: tuple


def read_peer_result(path: Path) -> PeerResult:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return PeerResult(tensors, json.loads(meta.get("refused", "{}")), meta.get("error", ""),
                      meta.get("peer_version", ""), tuple(json.loads(meta.get("order", "[]"))))


def ensure_peer_venv(venv: Path) -> Path:
    """The peer venv's python, creating the venv (outside this checkout) when it is missing."""
    venv = venv.resolve()
    if venv == ROOT or ROOT in venv.parents:
        sys.exit(f"--peer-venv {venv} is inside this checkout; the peer imports as interp_engine too, so "
                 f"put its venv outside any checkout (e.g. {DEFAULT_VENV})")
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating the peer's venv at {venv} ({', '.join(PEER_PACKAGES)})", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True)
    probe = "import interp_engine, torch, transformers; print(interp_engine.__version__, interp_engine.__file__)"
    version, where = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True,
                                    cwd=tempfile.gettempdir(), env=_clean_env()).stdout.split()
    if venv not in Path(where).resolve().parents:
        sys.exit(f"the peer venv at {venv} imports interp_engine from {where}, not from itself")
    return python


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def run_peer(python: Path, folders: dict[str, Path], tokens, work: Path) -> dict[str, Path]:
    """Run bench/peer_side.py in the peer's venv over every folder; family -> exchange file."""
    outs = {name: work / f"peer-{name}.safetensors" for name in folders}
    job = {"tokens": tokens, "models": [{"name": n, "folder": str(f), "out": str(outs[n])}
                                        for n, f in folders.items()]}
    (work / "job.json").write_text(json.dumps(job))
    with open(work / "peer.log", "w") as log:
        done = subprocess.run([str(python), str(PEER_SIDE), str(work / "job.json")], cwd=work, env=_clean_env(),
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"the peer's side failed (exit {done.returncode}); its log: {work / 'peer.log'}")
    return outs


# --- the comparison --------------------------------------------------------------------------------

#: outcomes that fail the run
FAILING = ("DIFFERS", "STALE", "SHAPE")


@dataclasses.dataclass
class Row:
    """One peer point name on one family, over every layer both serve."""

    family: str
    name: str
    ours: str = ""
    outcome: str = "agrees"
    error: float = 0.0
    layers: list = dataclasses.field(default_factory=list)
    note: str = ""

    def merge(self, outcome: str, error: float, layer, note: str = "") -> None:
        rank = ("agrees", "deliberate") + FAILING
        if rank.index(outcome) > rank.index(self.outcome):
            self.outcome = outcome
        self.error = max(self.error, error)
        self.layers.append(layer)
        self.note = note or self.note


def fit(ours, shape):
    """``ours`` in the peer's layout: the same tensor, or reshaped where only the trailing axes'
    split differs (our heads ``[b, p, h, d]``, the peer's flat ``[b, p, h·d]``); None otherwise."""
    if tuple(ours.shape) == tuple(shape):
        return ours
    if ours.numel() == shape.numel() and tuple(ours.shape[:2]) == tuple(shape[:2]):
        return ours.reshape(shape)
    return None


def judge(peer_address: str, ours, want, ctx: Context) -> tuple[str, float, str]:
    """(outcome, relative error, note) for one address."""
    from interp_engine import relative_error

    got = fit(ours, want.shape)
    if got is None:
        return "SHAPE", float("inf"), f"ours {tuple(ours.shape)}, the peer's {tuple(want.shape)}"
    error = relative_error(got, want)
    rule = DELIBERATE_BY_NAME.get(peer_address.partition(".")[0])
    if rule is None or not rule.applies(ctx):
        return ("agrees" if error <= TOLERANCE else "DIFFERS"), error, ""
    if error <= TOLERANCE:
        return "STALE", error, f"listed as a deliberate difference but agrees: mend DELIBERATE ({rule.why})"
    note = rule.why
    if rule.ours_is is not None:
        twin = rule.ours_is(ctx)
        twin_error = relative_error(got, twin)
        if twin_error > TOLERANCE:
            return "DIFFERS", error, f"{note}; yet ours differs from {rule.ours_is_called} too ({twin_error:.1e})"
        note += f"; ours equals {rule.ours_is_called} ({twin_error:.1e})"
    return "deliberate", error, note


def compare_family(family: str, folder: Path, tokens, peer: dict, peer_refused: dict) -> tuple[list[Row], dict]:
    """Rows for every point the peer serves on ``family``, and our served names the peer has no
    name for (our site -> why)."""
    import torch

    from interp_engine import SITES, Address, load_model, run_with_cache

    config = json.loads((folder / "config.json").read_text())
    model = load_model(str(folder), backend="eager")
    served = set(model.points())
    wanted, rows = {}, {}
    for address in peer:
        name, _, layer = address.partition(".")
        row = rows.setdefault(name, Row(family, name))
        mapped = our_address(address, SITES)
        if mapped is None:
            row.outcome, row.note = "not served by us", "no such name here"
            continue
        site, layer = mapped
        row.ours = site
        streams = range(model.info.n_streams) if SITES[site].per_stream else [None]
        ours = [Address(site, layer, s) for s in streams]
        if all(a in served for a in ours):
            wanted[address] = ours
        elif not row.layers:
            row.outcome, row.note = "not served by us", f"{site} is not served on {family}"
    cache = run_with_cache(model, torch.tensor(tokens), list(dict.fromkeys(a for v in wanted.values() for a in v)))
    for address, ours in wanted.items():
        got = cache[ours[0]] if len(ours) == 1 else torch.stack([cache[a] for a in ours], dim=2)
        row = rows[address.partition(".")[0]]
        if row.outcome == "not served by us":
            row.outcome, row.note = "agrees", "not served by us at some layers"
        outcome, error, note = judge(address, got, peer[address], Context(config, peer, address))
        row.merge(outcome, error, ours[0].layer, note)
    mapped_to = {r.ours for r in rows.values() if r.outcome != "not served by us"}
    ours_only = {a.name: peer_refused.get(_peer_name(a.name), "the peer has no such point")
                 for a in served if a.name not in mapped_to}
    del model
    return list(rows.values()), ours_only


def _peer_name(ours: str) -> str:
    return next((p for p, o in ALIASES.items() if o == ours), ours)


# --- the report ------------------------------------------------------------------------------------


def _families_text(fams: list[str], total: int) -> str:
    return f"all {total} families" if len(fams) == total and total > 1 else ", ".join(fams)


def report(rows: list[Row], ours_only: dict[str, dict], errors: dict[str, str], header: str) -> str:
    """The markdown report: one line per peer point name over the families, then the deliberate
    differences, the names only we serve, and the failures with their family and layers."""
    compared = sorted({r.family for r in rows})
    out = [header, "", "| peer point | ours | agrees ≤ 1e-5 (worst error) | deliberate difference | not served by us |",
           "| --- | --- | --- | --- | --- |"]
    names = list(dict.fromkeys(r.name for r in rows))
    for name in names:
        mine = [r for r in rows if r.name == name]
        ours = ", ".join(sorted({r.ours for r in mine if r.ours})) or "—"
        agree = [r for r in mine if r.outcome == "agrees"]
        deliberate = [r for r in mine if r.outcome == "deliberate"]
        absent = [r.family for r in mine if r.outcome == "not served by us"]
        cells = [f"{len(agree)} ({max(r.error for r in agree):.1e})" if agree else "—",
                 f"{', '.join(r.family for r in deliberate)} ({max(r.error for r in deliberate):.1e})"
                 if deliberate else "—",
                 _families_text(absent, len(compared)) or "—"]
        out.append(f"| `{name}` | {ours} | " + " | ".join(cells) + " |")
    out += ["", "Deliberate differences (where they apply, with the largest relative difference):", ""]
    for rule in DELIBERATE:
        hit = [r for r in rows if r.name == rule.name and r.outcome == "deliberate"]
        if hit:
            worst = max(hit, key=lambda r: r.error)
            out.append(f"- `{rule.name}` on {', '.join(r.family for r in hit)} (up to {worst.error:.2g}): "
                       f"{worst.note}")
    only: dict[str, list[str]] = {}
    for family, names_ in sorted(ours_only.items()):
        for name in names_:
            only.setdefault(name, []).append(family)
    out += ["", "Served by us, not by the peer on these families: " + "; ".join(
        f"`{n}` ({_families_text(f, len(compared))})" for n, f in sorted(only.items())) + "."]
    if errors:
        out += ["", "Families not compared:", ""] + [f"- {f}: {e}" for f, e in sorted(errors.items())]
    failing = [r for r in rows if r.outcome in FAILING]
    out += ["", f"**{len(failing)} failing** (a shared name that differs without a listed reason, or a "
            "listed difference that no longer differs)" + (":" if failing else ".")]
    out += [f"- {r.family} `{r.name}` ↔ `{r.ours}` {r.outcome} at layers {r.layers}: {r.error:.2g} {r.note}"
            for r in failing]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV,
                        help=f"the peer's own venv, created when missing (default {DEFAULT_VENV})")
    parser.add_argument("--families", nargs="*", help="a subset of the tiny families (default: all)")
    parser.add_argument("--work", type=Path, help="keep checkpoints and exchange files here (default: a temp dir)")
    args = parser.parse_args(argv)
    import torch
    import transformers

    import interp_engine

    builders = families()
    chosen = args.families or list(builders)
    unknown = [f for f in chosen if f not in builders]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(builders)}")
    python = ensure_peer_venv(args.peer_venv)
    with tempfile.TemporaryDirectory(prefix="peer-points-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        folders = {f: builders[f](work / "checkpoints") for f in chosen}
        tokens = token_rows()
        outs = run_peer(python, folders, tokens, work)  # first the peer, alone in its process
        rows, ours_only, errors, version, order = [], {}, {}, "", {}
        for family, folder in folders.items():  # then ours, one model at a time
            peer = read_peer_result(outs[family])
            version = peer.version
            order.update(dict.fromkeys(peer.order))
            if peer.error:
                errors[family] = f"the peer: {peer.error.splitlines()[0][:300]}"
                continue
            try:
                found, ours_only[family] = compare_family(family, folder, tokens, peer.tensors, peer.refused)
            except Exception as err:
                errors[family] = f"ours: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
                continue
            rows += found
    header = (f"interp_engine {interp_engine.__version__} (ours) vs interp-engine {version} (the peer, its own "
              f"venv); torch {torch.__version__}, transformers {transformers.__version__}; {len(tokens)} rows × "
              f"{len(tokens[0])} tokens, every layer; {len(ours_only)} of {len(chosen)} families compared")
    rows.sort(key=lambda r: list(order).index(r.name) if r.name in order else len(order))
    print(report(rows, ours_only, errors, header))
    return 1 if any(r.outcome in FAILING for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
