"""`make demo` end to end, so the main job cannot rot: it runs on the embedded SmolLM2, every
check it prints holds, the PNG is a real image, and the logit lens's answer is the model's own
(checked against a plain transformers forward that shares no code with the engine)."""

from __future__ import annotations

import json
import re

import torch

from interp_engine import embedded
from interp_engine.examples import demo

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def hf_next_token(prompt: str) -> str:
    """The next token of the embedded model by plain transformers: no hooks, no engine code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded.ensure()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    return tok.decode([int(logits[0, -1].argmax())])


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    status = demo.main(["--out", str(out)])
    printed = capsys.readouterr().out

    assert status == 0, printed
    assert "FAILED" not in printed
    summary = re.search(r"(\d+)/(\d+) checks passed", printed)
    assert summary and summary.group(1) == summary.group(2) and int(summary.group(2)) >= 12, printed

    # The identities of the address contract, each printed as a passing check.
    for identity in (
        "resid_mid.10 == resid_pre.10 + attn_out.10",
        "resid_post.10 == resid_mid.10 + mlp_out.10",
        "sum over heads == attn_out.10",
        "lens at the last layer == the model's logits",
        "positions == len(prompt) + len(generated) - 1",
        "gradient reached the embedding",
    ):
        line = next((ln for ln in printed.splitlines() if identity in ln), None)
        assert line is not None and line.rstrip().endswith("ok"), f"{identity!r} not printed as ok:\n{printed}"
    for heading in ("One point", "Several points", "Every layer", "A batch", "Per-head contributions",
                    "Gradients", "While generating", "Logit lens"):
        assert f"== {heading}" in printed
    assert re.search(r"completion\.text = '.+'", printed)

    # The PNG: where the demo says, a real PNG, not empty.
    png = out / "logit_lens.png"
    assert f"heatmap written to {png.resolve()}" in printed
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    # The lens table: one row per layer; the last layer's last position is the model's answer.
    record = json.loads((out / "logit_lens.json").read_text())
    assert record["layers"] == list(range(30))
    assert len(record["top_tokens"]) == 30
    assert all(len(row) == len(record["input_tokens"]) for row in record["top_tokens"])
    oracle = hf_next_token(demo.PROMPT)
    assert oracle == " Paris"
    assert record["answer"] == oracle == record["top_tokens"][-1][-1]
    assert all(0 < p <= 1 for row in record["top_probs"] for p in row)

    # The cluster part: the same capture through 2 replicas, and a Parquet dataset on disk.
    for check in ("cluster capture == local capture on the same rows", "cluster capture == local batch (relative",
                  "dataset rows (one per token) == tokens of the prompts"):
        line = next((ln for ln in printed.splitlines() if check in ln), None)
        assert line is not None and line.rstrip().endswith("ok"), f"{check!r} not printed as ok:\n{printed}"
    import pyarrow.parquet as pq

    table = pq.read_table(out / "activations")
    rows = int(re.search(r"dataset: (\d+) rows", printed).group(1))
    assert table.num_rows == rows > 0
