"""The eager backend on a GPU against the same model on the CPU: every dense site, ``pattern``
and the logits of SmolLM2-135M (the embedded model), captured on the GPU in fp32 (TF32 off) and
in bf16, each compared with the CPU fp32 capture by the engine's relative error
(``interp_engine.compare.relative_error``: ``max|gpu - cpu| / max|cpu|`` per address).

A GPU and a CPU are different computations (other kernels, other summation orders), so this
is a tolerance, not bitwise equality: fp32 must stay within 1e-4; bf16 is reported as measured
(the README's equality section states what the GPU run showed).

    python bench/gpu/parity.py --device cuda --out results/   # the GPU run (bench/gpu/check.sh)
    python bench/gpu/parity.py --device cpu --tiny            # a smoke run of the same code
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from interp_engine import load_model, run_with_cache
from interp_engine.compare import relative_error

DENSE_SITES = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "q", "k", "v", "mlp_post"]
PROMPTS = ["The capital of France is", "Interpretability research reads the residual stream of a model."]
FP32_BOUND = 1e-4


def tiny_model_folder() -> str:
    """A tiny random Llama saved as an HF folder (the smoke run's stand-in for SmolLM2)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import tiny

    return str(tiny.build("llama", Path(tempfile.mkdtemp(prefix="gpu-parity-"))))


def capture(name: str, device: str | None, dtype: str) -> dict:
    model = load_model(name, backend="eager", dtype=dtype, device=device)
    points = [p for p in model.points() if p.name in DENSE_SITES or p.name in ("pattern", "logits")]
    out = {}
    for prompt in PROMPTS:
        cache = run_with_cache(model, model.to_tokens(prompt), points)
        out[prompt] = {str(a): t.float().cpu() for a, t in cache.items()}
    del model
    return out


def compare(got: dict, want: dict) -> dict:
    """Per site: the worst relative error over layers and prompts, and where it was."""
    worst: dict[str, tuple[float, str]] = {}
    for prompt, tensors in want.items():
        for address, reference in tensors.items():
            err = relative_error(got[prompt][address], reference)
            site = address.split(".")[0]
            if site not in worst or err > worst[site][0]:
                worst[site] = (err, address)
    return {site: {"max_rel_error": e, "at": a} for site, (e, a) in sorted(worst.items())}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2 (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="folder for parity.json")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = tiny_model_folder() if args.tiny else "HuggingFaceTB/SmolLM2-135M-Instruct"

    reference = capture(name, None, "float32")
    result = {"model": "tiny-llama" if args.tiny else name, "device": args.device, "torch": torch.__version__,
              "prompts": PROMPTS, "fp32_bound": FP32_BOUND}
    for dtype in ("float32", "bfloat16"):
        result[dtype] = compare(capture(name, args.device, dtype), reference)
    result["fp32_max"] = max(v["max_rel_error"] for v in result["float32"].values())
    result["bf16_max"] = max(v["max_rel_error"] for v in result["bfloat16"].values())
    result["fp32_within_bound"] = result["fp32_max"] <= FP32_BOUND

    print(f"{result['model']}: {args.device} vs CPU fp32, worst relative error per site over every layer and "
          f"{len(PROMPTS)} prompts")
    print("| site | fp32 | where | bf16 | where |\n| --- | ---: | --- | ---: | --- |")
    for site in result["float32"]:
        f, b = result["float32"][site], result["bfloat16"][site]
        print(f"| {site} | {f['max_rel_error']:.2e} | {f['at']} | {b['max_rel_error']:.2e} | {b['at']} |")
    print(f"fp32 worst {result['fp32_max']:.2e} (bound {FP32_BOUND:g}: "
          f"{'ok' if result['fp32_within_bound'] else 'EXCEEDED'}); bf16 worst {result['bf16_max']:.2e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parity.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
