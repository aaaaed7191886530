"""docs/tutorial.py (the TransformerLens-style walk through the logit lens, the decomposition and
head attribution on the embedded SmolLM2) runs as written: it asserts its own identities."""

import runpy
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.py"


def test_tutorial_runs_as_written(capsys):
    namespace = runpy.run_path(str(TUTORIAL), run_name="__main__")
    printed = capsys.readouterr().out
    assert namespace["answer"] == " Paris" and "top heads: L" in printed
    assert namespace["per_head"].shape == (30, 9)
