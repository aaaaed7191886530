"""Point by point against the peer: every name both engines serve gives the same tensor.

decoderesearch's ``interp-engine`` (PyPI, the engine behind Neuronpedia) speaks the vocabulary
this project's address space grew from. This script saves the tiny random checkpoints the tests
build (tests/tiny*.py: every family, fixed seed, byte tokenizer) as Hugging Face folders, runs the
peer on each in the peer's **own** virtual environment (it imports as ``interp_engine`` too, so it
never shares ours: bench/peer_side.py runs there and hands its tensors back as safetensors files),
then runs ours (``load_model(folder, backend="eager")``) on the same token rows and compares,
per family and point name over every layer both serve, with :func:`interp_engine.relative_error`.

Each peer point ends as one of:

- ``agrees``: the same tensor within 1e-5 relative at every layer;
- ``deliberate``: the two engines define the name differently on purpose, as the DELIBERATE table
  of bench/peer_names.py says and why (where the peer serves our tensor under another name,
  ours must equal that one);
- failing, and the run exits 1: ``DIFFERS`` (a shared name that differs without a reason in the
  table), ``STALE`` (a listed difference that no longer differs: mend the table), ``SHAPE``, or
  ``RAISES`` (our capture raised where our model says it serves the point);
- ``not served by us`` (the peer serves it, this model here does not) and, listed per family,
  the names we serve and the peer does not.

Names that differ only in spelling are mapped (peer_names.ALIASES); layouts that differ only in
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

from peer_names import DELIBERATE, SITES_ALIASED_FROM, Context, judge, our_addresses  # bench/peer_names.py

ROOT = Path(__file__).resolve().parents[1]
PEER_SIDE = Path(__file__).resolve().with_name("peer_side.py")
PEER_PACKAGES = ("torch==2.13.0", "transformers==5.19.0", "interp-engine==1.14.2")
DEFAULT_VENV = Path.home() / ".cache" / "interp_engine" / "peer-venv-1.14.2"

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
    pinned = next(p.split("==")[1] for p in PEER_PACKAGES if p.startswith("interp-engine"))
    if version != pinned:
        print(f"note: the peer venv at {venv} holds interp-engine {version}, not the pinned {pinned}", file=sys.stderr)
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
FAILING = ("DIFFERS", "STALE", "SHAPE", "RAISES")


@dataclasses.dataclass
class Row:
    """One peer point name against one name of ours (``ours``; empty: we have none) on one
    family, over every layer both serve."""

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
        name = address.partition(".")[0]
        mapped = our_addresses(address, SITES, {a.name for a in served})
        if not mapped:
            rows.setdefault((name, ""), Row(family, name, "", "not served by us", note="no such name here"))
        for site, layer in mapped:
            row = rows.setdefault((name, site), Row(family, name, site, "not served by us"))
            streams = range(model.info.n_streams) if SITES[site].per_stream else [None]
            ours = [Address(site, layer, s) for s in streams]
            if all(a in served for a in ours):
                wanted[address, site] = ours
    cache, raised = capture(model, torch.tensor(tokens), list(dict.fromkeys(a for v in wanted.values() for a in v)))
    for (address, site), ours in wanted.items():
        row = rows[address.partition(".")[0], site]
        if row.outcome == "not served by us":
            row.outcome = "agrees"  # until judged otherwise
        if site in raised:
            row.outcome, row.note = "RAISES", f"our capture of {site} raised {raised[site]}"
            continue
        got = cache[ours[0]] if len(ours) == 1 else torch.stack([cache[a] for a in ours], dim=2)
        outcome, error, note = judge(address, site, got, peer[address], Context(config, peer, address))
        row.merge(outcome, error, ours[0].layer, note)
    mapped_to = {r.ours for r in rows.values() if r.outcome != "not served by us"}
    ours_only = {a.name: peer_refused.get(SITES_ALIASED_FROM.get(a.name, a.name), "the peer has no such point")
                 for a in served if a.name not in mapped_to}
    del model
    return list(rows.values()), ours_only


def capture(model, tokens, addresses: list) -> tuple[dict, dict[str, str]]:
    """Our tensors for ``addresses`` in one call; where that raises, each site's addresses alone,
    so one site that fails is reported (site -> the error) and the others are still compared."""
    from interp_engine import run_with_cache

    def run(some):
        cache = run_with_cache(model, tokens, some)
        return {a: cache[a] for a in some}

    try:
        return run(addresses), {}
    except Exception:
        pass
    tensors, raised = {}, {}
    for site in dict.fromkeys(a.name for a in addresses):
        try:
            tensors.update(run([a for a in addresses if a.name == site]))
        except Exception as err:
            raised[site] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return tensors, raised




# --- the report ------------------------------------------------------------------------------------


def _families_text(fams: list[str], total: int) -> str:
    return f"all {total} families" if len(fams) == total and total > 1 else ", ".join(fams)


def report(rows: list[Row], ours_only: dict[str, dict], errors: dict[str, tuple[str, str]], header: str) -> str:
    """The markdown report: one line per peer point name over the families, then the deliberate
    differences, the names only we serve, and the failures with their family and layers."""
    compared = sorted({r.family for r in rows})
    out = [header, "",
           "| peer point | ours | agrees ≤ 1e-5 (worst error) | deliberate difference | fails | not served by us |",
           "| --- | --- | --- | --- | --- | --- |"]
    for name, ours in dict.fromkeys((r.name, r.ours) for r in rows):
        mine = [r for r in rows if (r.name, r.ours) == (name, ours)]
        agree = [r for r in mine if r.outcome == "agrees"]
        deliberate = [r for r in mine if r.outcome == "deliberate"]
        absent = [r.family for r in mine if r.outcome == "not served by us"]
        cells = [f"{len(agree)} ({max(r.error for r in agree):.1e})" if agree else "—",
                 f"{', '.join(r.family for r in deliberate)} ({max(r.error for r in deliberate):.1e})"
                 if deliberate else "—",
                 ", ".join(f"{r.family} ({r.outcome})" for r in mine if r.outcome in FAILING) or "—",
                 _families_text(absent, len(compared)) or "—"]
        out.append(f"| `{name}` | {f'`{ours}`' if ours else '—'} | " + " | ".join(cells) + " |")
    out += ["", "Deliberate differences (where they apply, with the largest relative difference):", ""]
    for rule in DELIBERATE:
        hit = [r for r in rows if (r.name, r.ours) == (rule.name, rule.ours) and r.outcome == "deliberate"]
        if hit:
            worst = max(hit, key=lambda r: r.error)
            out.append(f"- `{rule.name}` ↔ our `{rule.ours}` on {', '.join(r.family for r in hit)} "
                       f"(up to {worst.error:.2g}): {worst.note}")
    only: dict[str, list[str]] = {}
    for family, names_ in sorted(ours_only.items()):
        for name in names_:
            only.setdefault(name, []).append(family)
    out += ["", "Served by us, not by the peer on these families: " + ("; ".join(
        f"`{n}` ({_families_text(f, len(compared))})" for n, f in sorted(only.items())) or "none") + "."]
    if errors:
        out += ["", "Families not compared (one whose load or capture of ours raised fails the run):", ""]
        out += [f"- {family}: {side}: {error}" for family, (side, error) in sorted(errors.items())]
    failing = [r for r in rows if r.outcome in FAILING]
    ours_raised = sorted(f for f, (side, _) in errors.items() if side == "ours")
    out += ["", f"**{len(failing)} failing** (a shared name that differs without a listed reason, or a listed "
            "difference that no longer differs, or a capture of ours that raised)" + (":" if failing else ".")]
    out += [f"- {r.family} `{r.name}` ↔ `{r.ours}` {r.outcome}"
            + (f" at layers {r.layers}: relative difference {r.error:.2g}" if r.layers else "")
            + (f"; {r.note}" if r.note else "") for r in failing]
    if ours_raised:
        out += ["", f"**Ours raised on {', '.join(ours_raised)}** (see above): failing."]
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
                errors[family] = ("the peer", peer.error.splitlines()[0][:300])
                continue
            try:
                found, ours_only[family] = compare_family(family, folder, tokens, peer.tensors, peer.refused)
            except Exception as err:
                errors[family] = ("ours", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
                continue
            rows += found
    header = (f"interp_engine {interp_engine.__version__} (ours) vs interp-engine {version} (the peer, its own "
              f"venv); torch {torch.__version__}, transformers {transformers.__version__}; {len(tokens)} rows × "
              f"{len(tokens[0])} tokens, every layer; {len(ours_only)} of {len(chosen)} families compared")
    rows.sort(key=lambda r: list(order).index(r.name) if r.name in order else len(order))
    print(report(rows, ours_only, errors, header))
    return 1 if any(r.outcome in FAILING for r in rows) or any(side == "ours" for side, _ in errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
