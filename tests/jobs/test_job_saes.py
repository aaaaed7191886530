"""The job config's ``saes:`` (issue 36): dictionaries named in the config (a SAELens folder,
beside the config) reach ``build_dataset``, so feature points build as they do from Python.
No Ray: the job's ``load_model`` is given the shared eager model."""

from __future__ import annotations


import yaml

from interp_engine import build_dataset, load_dictionary
from interp_engine.jobs import build_dataset as job
from interp_engine.jobs.config import load_config

from ..features.test_features_load import saelens_folder, v6
from ..sparse_dicts import random_weights


def test_config_saes_reach_the_build(tmp_path, tiny_path, eager_models, monkeypatch):
    eager = eager_models("llama")
    saelens_folder(tmp_path / "sae", v6("standard", hook="blocks.1.hook_resid_post", d_in=128, d_sae=384),
                   random_weights(0))
    prompts = ["Hello there", "The quick brown fox", "abc"]
    points = ["resid_post.1.features", "resid_post.1.sae_error"]
    (tmp_path / "build.yaml").write_text(yaml.safe_dump({
        "model": str(tiny_path("llama")), "prompts": prompts, "points": points, "output": str(tmp_path / "job"),
        "saes": ["sae"], "progress": False}))
    config = load_config(tmp_path / "build.yaml")
    assert config.saes[0].path == str(tmp_path / "sae")  # read beside the config
    monkeypatch.setattr(eager, "close", lambda: None, raising=False)
    monkeypatch.setattr("interp_engine.load_model", lambda *args, **kwargs: eager)
    built = job.run(config)
    want = build_dataset(eager, prompts, points, tmp_path / "python", saes=[load_dictionary(tmp_path / "sae")],
                         progress=False)
    assert built.to_arrow().equals(want.to_arrow())
    assert any("features" in name for name in built.to_arrow().column_names), built.to_arrow().column_names


def test_the_example_job_shows_progress_and_writes_under_the_users_home():
    from pathlib import Path

    from .. import docs_blocks

    config = load_config(docs_blocks.ROOT / "jobs/examples/build.yaml")
    assert config.progress is True
    assert Path(config.output).is_relative_to(Path.home()), config.output
    assert load_config({"prompts": ["a"], "points": ["resid_post.1"], "output": "s3://b/~x"}).output == "s3://b/~x"
