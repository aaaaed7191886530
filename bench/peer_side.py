"""The peer's half of bench/peer_points.py: runs INSIDE the peer's own virtual environment.

decoderesearch's ``interp-engine`` imports as ``interp_engine`` too, so it can never share a venv
with this project; bench/peer_points.py starts this file with the peer venv's python. It reads a
job (JSON: the token rows and, per model, a checkpoint folder and an output path), loads each
checkpoint on the peer's eager backend (its default: fp32, eager attention, CPU), captures every
point the peer serves on that model at every layer in one ``run_with_cache``, and writes the
tensors to a safetensors file keyed by the peer's address strings (``resid_post.1``,
``embeddings``). The file's metadata carries the peer's version, why it refused each point it
refused (JSON), and the error if the model did not load. Nothing crosses the process boundary as
pickle.

Deliberately standalone: imports only the standard library, torch, safetensors and the peer.
"""

from __future__ import annotations

import json
import sys
import traceback


def served_points(model) -> tuple[list[str], dict[str, str]]:
    """Every address the peer serves on ``model`` (its own point table, every layer), and for each
    point it serves on no layer, its first refusal."""
    served, refused = [], {}
    for spec in model.points():
        layers = range(model.n_layers) if spec.scope.name == "LAYER" else [None]
        here = []
        for layer in layers:
            address = spec.name if layer is None else f"{spec.name}.{layer}"
            why = model.refuses(address)
            if why is None:
                here.append(address)
            else:
                refused.setdefault(spec.name, why)
        if here:
            refused.pop(spec.name, None)
        served += here
    return served, refused


def capture(model, tokens, points: list[str], refused: dict) -> dict:
    """The peer's tensors for ``points`` in one ``run_with_cache``; where that raises (its
    ``refuses`` can pass a point its capture then refuses: ``attn_probs`` on a hybrid model's
    linear-attention layers), each point's layers together, then each address alone, recording
    in ``refused`` (point name, or address where only some layers fail) what the capture said."""
    from interp_engine import run_with_cache

    def run(addresses):
        return {str(a): t for a, t in run_with_cache(model, tokens, addresses).tensors.items()}

    try:
        return run(points)
    except Exception:
        pass
    tensors = {}
    for name in dict.fromkeys(p.partition(".")[0] for p in points):
        group = [p for p in points if p.partition(".")[0] == name]
        try:
            tensors.update(run(group))
            continue
        except Exception:
            pass
        failed = {}
        for address in group:
            try:
                tensors.update(run([address]))
            except Exception as err:
                failed[address] = f"its capture raised {type(err).__name__}: {err}"
        if len(failed) == len(group):
            refused[name] = next(iter(failed.values()))
        else:
            refused.update(failed)
    return tensors


def write_result(out: str, tensors: dict, version: str, refused: dict, error: str = "", order=()) -> None:
    """The exchange file: ``tensors`` (address string -> tensor) and, as safetensors metadata
    (strings only), the peer's version, its refusals and its point table's order as JSON, and the
    error if any. Each tensor is
    copied: the peer hands one tensor under two names where they alias (attn_out_post on a family
    without post-norms), which safetensors refuses to store twice."""
    from safetensors.torch import save_file

    meta = {"peer_version": version, "refused": json.dumps(refused), "order": json.dumps(list(order)),
            "error": error}
    save_file({k: t.detach().clone().contiguous() for k, t in tensors.items()}, out, metadata=meta)


def capture_one(folder: str, tokens, out: str) -> None:
    import interp_engine
    import torch

    tensors, refused, error, order = {}, {}, "", []
    try:
        model = interp_engine.load_model(folder, backend="eager", device="cpu", dtype="float32")
        order = [spec.name for spec in model.points()]
        points, refused = served_points(model)
        tensors = capture(model, torch.tensor(tokens), points, refused)
    except Exception as err:  # one family the peer cannot run must not hide the others
        error = f"{type(err).__name__}: {err}".strip()[:2000]
        traceback.print_exc()
    write_result(out, tensors, interp_engine.__version__, refused, error, order)


def main(job_path: str) -> None:
    import interp_engine

    print(f"peer interp_engine {interp_engine.__version__} from {interp_engine.__file__}", file=sys.stderr)
    with open(job_path) as f:
        job = json.load(f)
    for entry in job["models"]:
        print(f"peer: {entry['name']}", file=sys.stderr, flush=True)
        capture_one(entry["folder"], job["tokens"], entry["out"])


if __name__ == "__main__":
    main(sys.argv[1])
