"""A client process of the capture service for tests/service/eager/test_service.py: a fixed catalogue of mixed
requests (batched captures, generations, edits, position selections, async captures), run against
a connected service from a separate process and saved as files the test compares with the same
requests on a local model.

    python -m tests.service.service_client TARGET OUT FIRST COUNT [--no-ray]

TARGET is a service name (through Ray: RAY_ADDRESS) or its URL (the token in $SERVICE_TOKEN).
``--no-ray`` makes ``import ray`` fail in this process, so an HTTP client proves it needs no Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import torch

PROMPTS = ["The quick brown fox", "jumps", "over the lazy dog again", "!", "Hello there", "abc"]


def request(model, i: int):
    """Request ``i`` of the catalogue on ``model``: ``(completion or None, {address string: tensor})``."""
    from interp_engine import Add, Ablate, Rotate, Scale, Swap, Zero, capture_generation, run_with_cache

    kind = i % 6
    prompt = PROMPTS[i % len(PROMPTS)]
    one = model.to_tokens(prompt)
    if kind == 0:
        batch = model.to_tokens([prompt, PROMPTS[(i + 1) % len(PROMPTS)], PROMPTS[(i + 2) % len(PROMPTS)]])
        return None, _plain(run_with_cache(model, batch, ["resid_post.1", "z.0", "logits"]))
    if kind == 1:
        completion, cache = capture_generation(model, one, ["resid_post.2", "logits"], max_tokens=4)
        return completion, _plain(cache)
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(i))
    if kind == 2:
        direction = torch.randn(model.d_model, generator=torch.Generator().manual_seed(i + 1))
        return None, _plain(run_with_cache(model, one, ["resid_post.2", "attn_out.1"],
                                           edits={"resid_post.0": Add(vector, scale=2.0),
                                                  "mlp_out.1": [Ablate(vector), Rotate(direction, angle=0.5),
                                                                Swap(vector, projection=0.5, positions=[0])]}))
    if kind == 3:
        batch = model.to_tokens([prompt, PROMPTS[(i + 3) % len(PROMPTS)]])
        per_row = torch.randn(2, model.d_model, generator=torch.Generator().manual_seed(i))  # batched patching
        return None, _plain(run_with_cache(model, batch, ["logits", "mlp_out.1"], positions=-1,
                                           edits={"z.1": Zero(heads=[1]),
                                                  "resid_post.0": [Scale(0.5), Add(per_row, positions=[0])]}))
    if kind == 4:
        completion, cache = capture_generation(model, one, ["resid_post.1"], max_tokens=3, positions="generated",
                                               edits={"mlp_out.0": Scale(0.5)})
        return completion, _plain(cache)
    captured = asyncio.run(model.capture(one, ["resid_post.0", "v.2"], positions=[0, -1]))
    return None, {str(k): v for k, v in captured.items()}


def _plain(cache) -> dict:
    out = {str(k): v for k, v in cache.items()}
    out["tokens"] = cache.tokens
    if cache.positions is not None:
        out["positions"] = cache.positions
    return out


def save(out: Path, i: int, completion, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{i}.safetensors"))
    done = None if completion is None else [completion.text, list(completion.token_ids), completion.finish_reason]
    (out / f"{i}.json").write_text(json.dumps(done))


def load(out: Path, i: int):
    from safetensors.torch import load_file

    return json.loads((out / f"{i}.json").read_text()), load_file(str(out / f"{i}.safetensors"))


def main(argv: list[str]) -> None:
    target, out, first, count = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    if "--no-ray" in argv:
        sys.modules["ray"] = None  # any `import ray` in this process now fails
    from interp_engine import connect

    model = connect(target, token=os.environ.get("SERVICE_TOKEN"))
    out.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + count):
        save(out, i, *request(model, i))
    (out / "ray_imported").write_text(str("ray" in sys.modules and sys.modules["ray"] is not None))


if __name__ == "__main__":
    main(sys.argv[1:])
