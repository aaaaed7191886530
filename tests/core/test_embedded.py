"""The embedded SmolLM2: built offline from the packaged GGUF, safely by concurrent processes."""

import os
import subprocess
import sys

from interp_engine import embedded


def test_two_processes_build_the_folder_at_once(tmp_path):
    env = {**os.environ, "INTERP_ENGINE_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    code = "from interp_engine import embedded; print(embedded.ensure())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    target = tmp_path / "SmolLM2-135M-Instruct"
    assert {o[0].strip().splitlines()[-1] for o in outs} == {str(target)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-135M-Instruct"]  # no staging left behind
    assert (target / "model.safetensors").stat().st_size > 100e6
    assert (target / "tokenizer.json").exists()


def test_the_packaged_gguf_is_found():
    assert embedded.gguf_path().name == embedded.GGUF
