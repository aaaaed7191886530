"""docs/tutorial.py (the TransformerLens-style walk through the logit lens, the decomposition and
head attribution on the embedded SmolLM2) runs as written: it asserts its own identities."""

import runpy
from pathlib import Path

import torch

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.py"


def test_tutorial_runs_as_written(capsys):
    grad = torch.is_grad_enabled()  # the tutorial turns gradients off for its session, as notebooks do
    try:
        namespace = runpy.run_path(str(TUTORIAL), run_name="__main__")
    finally:
        torch.set_grad_enabled(grad)
    printed = capsys.readouterr().out
    assert namespace["answer"] == " Paris" and "top heads: L" in printed
    assert namespace["per_head"].shape == (30, 9)
    assert namespace["recovered"].shape == (30, 5) and "the answer moves from ' France' to ' is' at layer" in printed


def test_whole_site_on_smollm2_and_the_demo_lens_figure(tmp_path):
    """``"resid_post"`` on SmolLM2 is its 30 layers in order; the demo's lens record carries the
    embedding row and the answer's probability per layer, and the PNG is written."""
    import json

    from interp_engine import Address, load_model, run_with_cache
    from interp_engine.examples import demo

    model = load_model()
    assert model.points("resid_post") == [Address("resid_post", L) for L in range(30)]
    cache = run_with_cache(model, model.to_tokens(demo.PROMPT), ["resid_post", "logits"], positions=-1)
    assert list(cache)[:30] == model.points("resid_post")
    checks = demo.Checks()
    demo.lens_table(model, checks, tmp_path)
    assert not checks.failed
    record = json.loads((tmp_path / "logit_lens.json").read_text())
    assert record["layers"] == list(range(30)) and record["target"] == " Paris"
    assert record["embedding"]["top_tokens"][0] == "The"  # the embedding's lens reads the token itself back
    p_final = float(cache["logits"][0, -1].softmax(-1).max())
    assert abs(record["target_probs"][-1] - p_final) < 1e-4 and len(record["target_probs"]) == 30
    assert (tmp_path / "logit_lens.png").stat().st_size > 50_000
    assert torch.tensor(record["target_probs"]).argmax() == 29
