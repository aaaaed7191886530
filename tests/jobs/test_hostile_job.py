"""Hostile input to the dataset-build job (``jobs/build_dataset.py``), as a catalogue: configs
that repeat a key, nest 100,000 deep, carry a ``!!python/object`` tag, do not parse, are a folder
or ask for 10**12 threads; a binary prompts file; points the model lacks; an output someone else
holds. Each is one ``error: ...`` line naming the field (or file and line) and exit code 2, with
no traceback, and each is refused before Ray or a replica starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from interp_engine.jobs import build_dataset as job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def base(tiny_path, tmp_path):
    """A config that would build (prompts beside it), as a dict, and where to write variants."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"Prompt {i} about jobs"}) + "\n" for i in range(4)))
    return {"model": str(tiny_path("llama")), "prompts": str(prompts), "points": ["resid_post.1"],
            "output": str(tmp_path / "out"), "replicas": 1, "progress": False}


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the job gets as far as starting Ray and a replica."""
    def refuse(config):
        raise AssertionError("the job started Ray and a replica before refusing")

    monkeypatch.setattr(job, "run", refuse)


def _run(path: Path, capsys) -> tuple[int, str]:
    code = job.main([str(path)])
    err = capsys.readouterr().err
    return code, err


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


CONFIG_CASES = {  # file name, its text -> what the error line must say
    "duplicate key": ("dup.yaml", "points: [resid_post.1]\noutput: o\nprompts: [a]\npoints: [resid_post.2]\n",
                      r"dup.yaml:4: key 'points' appears twice in one mapping \(first at line 1\); keep one"),
    "duplicate json key": ("dup.json", '{"prompts": ["a"], "points": ["x"], "prompts": ["b"]}',
                           "key 'prompts' appears twice in one object"),
    "100,000 deep": ("deep.yaml", "points: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply to read"),
    "python tag": ("tag.yaml", "prompts: !!python/object/apply:os.system [echo pwned]\n",
                   r"tag.yaml:1:10: could not determine a constructor .*!!python/object are refused"),
    "does not parse": ("bad.yaml", "prompts: [a\npoints: : :\n", r"bad.yaml:2:\d+: not valid YAML"),
    "json does not parse": ("bad.json", '{"prompts": [', r"bad.json:1:\d+: not valid JSON"),
    "not utf-8": ("bin.yaml", b"points: [\xff\xfe]\n", r"bin.yaml:1: not UTF-8 text \(byte 0xff\)"),
    "not a mapping": ("list.yaml", "- a\n- b\n", "expected a mapping of fields"),
    "threads overflow": ("threads.yaml", "prompts: [a]\npoints: [resid_post.1]\noutput: o\ntorch_threads: "
                         + str(10 ** 12) + "\n", r"torch_threads: Input should be less than or equal to 4096"),
    "nan cpus": ("cpus.yaml", "prompts: [a]\npoints: [resid_post.1]\noutput: o\ncpus_per_replica: .nan\n",
                 "cpus_per_replica: Input should be a finite number"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_config_is_one_error_line(case, tmp_path, capsys, nothing_starts):
    name, text, said = CONFIG_CASES[case]
    code, err = _run(_write(tmp_path, name, text), capsys)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert re.search(said, err), err


def test_a_folder_as_config(tmp_path, capsys, nothing_starts):
    (tmp_path / "cfg.yaml").mkdir()
    code, err = _run(tmp_path / "cfg.yaml", capsys)
    assert code == 2 and "is a folder; pass a YAML or JSON file" in err


def _checked(base, tmp_path, capsys, **changes) -> str:
    path = _write(tmp_path, "build.yaml", yaml.safe_dump({**base, **changes}))
    started = time.perf_counter()
    code, err = _run(path, capsys)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert time.perf_counter() - started < 30, "checks before Ray should take seconds"
    return err


def test_a_binary_prompts_file_names_the_file_and_line(base, tmp_path, capsys, nothing_starts):
    binary = _write(tmp_path, "binary.jsonl", b'{"text": "fine"}\n\x89PNG\r\n\x1a\n\x00\x00\xff\xd8\n')
    err = _checked(base, tmp_path, capsys, prompts=str(binary))
    assert f"prompts: {binary}:2: not UTF-8 text (byte 0x89 at column 1)" in err


def test_prompts_and_points_are_checked_before_ray(base, tmp_path, capsys, nothing_starts):
    err = _checked(base, tmp_path, capsys, points=["resid_post.99"])
    assert "points:" in err and "resid_post.99" in err and "layer" in err
    err = _checked(base, tmp_path, capsys, points=["resid_post.1", "router_logits.0"])
    assert "points:" in err and "router_logits" in err
    long = _write(tmp_path, "long.jsonl", json.dumps({"text": "word " * 400}) + "\n")
    err = _checked(base, tmp_path, capsys, prompts=str(long))
    assert "prompts: prompt 0 of" in err and "longer than the model's 256 positions" in err
    err = _checked(base, tmp_path, capsys, prompts=str(tmp_path / "missing.jsonl"))
    assert "prompts: prompts file" in err and "does not exist" in err
    err = _checked(base, tmp_path, capsys, text_key="body")
    assert "prompts:" in err and "'body'" in err


def test_an_output_that_cannot_be_used_is_refused_before_ray(base, tmp_path, capsys, nothing_starts):
    from interp_engine.dataset.lease import Lease
    from interp_engine.dataset.store import Store

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    err = _checked(base, tmp_path, capsys, output=str(mine))
    assert "output:" in err and "not a dataset this engine wrote" in err and (mine / "notes.txt").exists()
    lease = Lease.acquire(Store.of(base["output"]))
    try:
        err = _checked(base, tmp_path, capsys)
        assert "output:" in err and f"another build {lease.build_id}" in err
    finally:
        lease.release()


def test_the_entrypoint_exits_2_without_a_traceback(tmp_path):
    """The real process: the exit code and stderr a shell or ``ray job submit`` sees."""
    path = _write(tmp_path, "tag.yaml", "prompts: !!python/object/apply:os.system [echo pwned]\n")
    done = subprocess.run([sys.executable, "jobs/build_dataset.py", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert "pwned" not in done.stdout + done.stderr
