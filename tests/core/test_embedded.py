"""The embedded SmolLM2: built offline from the packaged GGUF, safely by concurrent processes."""

import json
import subprocess
import sys

from safetensors import safe_open

from interp_engine import embedded

# Each process's build marks that it has started, then waits until both have: the two builds
# overlap for certain, however the processes are scheduled.
_BUILDER = """
import sys, time
from pathlib import Path
from interp_engine import embedded
target, started = Path(sys.argv[1]), Path(sys.argv[2])

def build(folder):
    (started / str(id(folder))).touch()
    deadline = time.time() + 60
    while len(list(started.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.01)
    (folder / "weights.bin").write_bytes(sys.argv[3].encode() * 1_000_000)
    (folder / "config.json").write_text('{"by": "' + sys.argv[3] + '"}')

print(embedded.build_once(target, build))
"""


def test_two_processes_build_the_folder_at_once(tmp_path):
    target, started = tmp_path / "cache" / "model", tmp_path / "started"
    started.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(target), str(started), name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in "ab"]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert len(list(started.iterdir())) == 2, "both processes should have built"
    assert [o[0].strip() for o in outs] == [str(target)] * 2
    assert [p.name for p in target.parent.iterdir()] == ["model"]  # no staging left behind
    winner = json.loads((target / "config.json").read_text())["by"]  # one build whole, never a mix
    assert (target / "weights.bin").read_bytes() == winner.encode() * 1_000_000


def test_a_built_folder_is_not_built_again(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert embedded.build_once(tmp_path / "model", lambda folder: 1 / 0) == tmp_path / "model"


def test_the_embedded_model_is_an_ordinary_hf_folder():
    """The packaged GGUF, dequantised (on first use: the cache the other tests load from)."""
    folder = embedded.ensure()
    assert folder == embedded.cache_dir() / "SmolLM2-135M-Instruct"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and "quantization_config" not in config
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert len(names) == 2 + 9 * config["num_hidden_layers"]  # embedding, final norm, 9 per layer
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert embed.shape == (config["vocab_size"], config["hidden_size"]) and embed.dtype.is_floating_point
    assert embed.abs().sum() > 0
    assert (folder / "tokenizer.json").exists()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_the_packaged_gguf_is_found():
    assert embedded.gguf_path().name == embedded.GGUF
