"""Every fenced code block of README.md and docs/*.md runs as written (tests/docs_blocks.py).

Python blocks run in a fresh interpreter each (a ``continues`` block after the blocks it
continues), with the results they promise checked (``# -> value`` and bare comparisons,
tests/docs_blocks.py), bash blocks under ``bash -e`` with this venv's ``python`` and ``ray`` first on PATH;
both in a copy of the repository, so relative paths (``jobs/examples/...``, ``out/``) mean what
they mean to a reader in a checkout. YAML blocks are job configs and must validate; the README's
layout block must name files that exist. Blocks marked ``<!-- skip: reason -->`` are skipped with
that reason (pytest prints it); the session summary counts them all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

from . import docs_blocks
from .docs_blocks import ROOT, STANDINS, Block

ALL = [b for doc in docs_blocks.DOCUMENTS for b in docs_blocks.blocks(doc)]
PYTHON = [group for doc in docs_blocks.DOCUMENTS for group in docs_blocks.python_groups(docs_blocks.blocks(doc))]
BASH = [b for b in ALL if b.lang in ("bash", "sh", "shell")]
EXAMPLE_OUTPUT = Path("~/interp_engine-examples/smollm2-l15").expanduser()  # jobs/examples/build.yaml
TIMEOUT = 600

DRIVER = """
import json, sys
from tests.docs_blocks import promised, shaped
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__", "__promised__": promised, "__shaped__": shaped}
for label, code in blocks:
    print(f"--- running {label}", flush=True)
    exec(compile(code, label, "exec"), namespace)
"""


def _skip_if_marked(block: Block) -> None:
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the repository's files (tracked and untracked, not ignored), and a clean slate
    for what the documented flows write outside it."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    copy = tmp_path_factory.mktemp("docs") / "repo"
    for name in listed:
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    shutil.rmtree(EXAMPLE_OUTPUT, ignore_errors=True)
    return copy


@pytest.fixture(scope="module")
def environ(checkout):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["INTERP_ENGINE_CLUSTER_STATE"] = str(checkout.parent / "cluster-state")
    # Ray's own temp dir, short (its socket paths must fit) and fresh: a bare ray.init() in a block
    # then starts its own cluster instead of joining one another test left in /tmp/ray
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rd", dir="/tmp")
    return env


def _run(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run ``command`` in its own process group; one that outlives ``TIMEOUT`` is a documented
    flow that hangs: the whole group (Ray daemons it started included) is killed and the test fails."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{command[:2]} did not finish within {TIMEOUT} s (a documented flow that hangs):\n"
                    f"{out[-3000:]}\n{err[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _standins(code: str, tiny_path) -> str:
    for hub_id, family in STANDINS.items():
        code = code.replace(hub_id, str(tiny_path(family)))
    return code


@pytest.mark.parametrize("group", PYTHON, ids=lambda g: g[0].id)
def test_python_block_runs(group: list[Block], checkout, environ, tiny_path, tmp_path):
    _skip_if_marked(group[0])
    script = tmp_path / "blocks.json"
    script.write_text(json.dumps([(b.id, _standins(docs_blocks.instrument(b)[0], tiny_path)) for b in group]))
    done = _run([sys.executable, "-c", DRIVER, str(script)], checkout, environ)
    assert done.returncode == 0, f"{group[0].id} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


_bash_results: dict[str, subprocess.CompletedProcess] = {}


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.id)
def test_bash_block_runs(block: Block, checkout, environ):
    _skip_if_marked(block)
    key = docs_blocks.command_key(block.code)
    if key not in _bash_results:  # the same commands shown in two docs run once
        state = Path(environ["INTERP_ENGINE_CLUSTER_STATE"])
        try:
            _bash_results[key] = _run(["bash", "-e", "-o", "pipefail", "-c", block.code], checkout, environ)
        finally:
            if (state / "cluster.json").exists():  # a flow that failed half-way leaves no cluster behind
                subprocess.run([sys.executable, "cluster/local_cluster.py", "stop"], cwd=checkout, env=environ,
                               capture_output=True, timeout=120)
    done = _bash_results[key]
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    if "jobs/examples/build.yaml" in block.code:
        _check_example_dataset()


def _check_example_dataset() -> None:
    """The example build wrote one row per token of its prompts (the tokenizer counts them)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from interp_engine import embedded

    prompts = [json.loads(line)["text"] for line in (ROOT / "jobs/examples/prompts.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(embedded.ensure())
    table = pq.read_table(EXAMPLE_OUTPUT)
    assert table.num_rows == sum(len(tok(p).input_ids) for p in prompts) > 0
    assert {"resid_post.15", "mlp_out.15"} <= set(table.column_names)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "yaml"], ids=lambda b: b.id)
def test_yaml_block_is_a_valid_job_config(block: Block):
    import yaml

    from interp_engine.jobs.config import load_config

    _skip_if_marked(block)
    config = load_config(yaml.safe_load(block.code))
    assert config.points


def test_readme_layout_names_files_that_exist():
    layout = next(b for b in ALL if b.path.name == "README.md" and b.lang == "text")
    folders: list[tuple[int, Path]] = []  # the folders the lines above are in, with their indents
    missing = []
    for line in layout.code.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 20:  # blank, or a description continued under its column
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = (folders[-1][1] if folders else Path()) / line.split()[0]
        if line.split()[0].endswith("/"):
            folders.append((indent, path))
        if not (ROOT / path).exists():
            missing.append(str(path))
    assert not missing, f"README's layout names {missing}, which do not exist"


def test_every_block_is_found_and_handled():
    """The parser finds every fence, and every block is run, validated or skipped with a reason."""
    for doc in docs_blocks.DOCUMENTS:
        assert len(docs_blocks.blocks(doc)) == docs_blocks.fence_count(doc), doc
    handled = {"python", "bash", "sh", "shell", "yaml"}
    loose = [b.id for b in ALL if b.lang not in handled and not (b.path.name == "README.md" and b.lang == "text")]
    assert not loose, f"blocks no test runs (give them a language, or mark them <!-- skip: why -->): {loose}"
    assert all(b.skip.strip() for b in ALL if b.skip is not None)


def test_a_wrong_promise_fails_the_block(tmp_path):
    """The runner checks what a block promises: a wrong ``# -> value`` or a false bare comparison
    fails the block, naming the doc line; right ones pass; a promise that is not one is an error."""
    doc = ROOT / "README.md"

    def run(code: str, checks: int = 1) -> None:
        source, found = docs_blocks.instrument(Block(doc, 10, "python", code))
        assert found == checks
        exec(compile(source, "block", "exec"), {"__promised__": docs_blocks.promised})

    run("import torch\nx = torch.zeros(1, 5)\nx.shape  # -> torch.Size([1, 5])  [batch, pos]\n"
        "x.shape  # -> [1, 5]\n(x.sum() + 2).item()  # -> 2.0\n' Paris'.strip()  # -> 'Paris'\nx.shape[1] == 5\n", 5)
    with pytest.raises(AssertionError, match=r"README.md:13: x.shape: the doc promises \[1, 6\], the code gives torch.Size\(\[1, 5\]\)"):
        run("import torch\nx = torch.zeros(1, 5)\nx.shape  # -> [1, 6]  [batch, pos]\n")
    with pytest.raises(AssertionError, match=r"README.md:13: x.shape\[1\] == 6 is false"):
        run("import torch\nx = torch.zeros(1, 5)\n(\n  x.shape[1] == 6\n)\n")
    with pytest.raises(AssertionError, match="promises True"):
        run("[1] == [1]  # -> True\n1  # -> True\n", 2)
    with pytest.raises(ValueError, match="README.md:11: a '# ->' promise"):
        run("x = 1  # -> 1\n")


def test_a_shape_comment_is_checked():
    """``name = expr  # [pos, d_model]``: the axes, the model's sizes by name, and every other symbol
    the same size wherever it appears in the blocks run together."""
    import types

    doc = ROOT / "README.md"
    model = types.SimpleNamespace(d_model=4, info=types.SimpleNamespace(n_experts=3))

    def run(code: str) -> dict:
        source, found = docs_blocks.instrument(Block(doc, 10, "python", code))
        assert found == code.count("# [")
        namespace = {"__shaped__": docs_blocks.shaped, "model": model}
        exec(compile(source, "block", "exec"), namespace)
        return namespace

    ok = run("import torch\nt = torch.zeros(1, 5)  # [1, pos]\nh = torch.zeros(5, 4)   # [pos, d_model]  prose\n"
             "e = torch.zeros(2, 5, 3)  # [batch, pos, n_experts]\n")
    assert ok["__shape_symbols__"] == {"pos": 5, "batch": 2} and ok["h"].shape == (5, 4)
    for code, message in (("t = torch.zeros(1, 5, 1)  # [1, pos]", r"README.md:12: t: the doc says \[1, pos\]"),
                          ("t = torch.zeros(2, 5)  # [1, pos]", r"gives \[2, 5\] \(1 = 1\)"),
                          ("t = torch.zeros(1, 5)  # [1, pos]\nh = torch.zeros(6, 4)  # [pos, d_model]", r"pos = 5"),
                          ("h = torch.zeros(5, 3)  # [pos, d_model]", r"d_model = 4"),
                          ("e = torch.zeros(5, 128)  # [pos, n_experts]", r"n_experts = 3")):
        with pytest.raises(AssertionError, match=message):
            run("import torch\n" + code + "\n")


def summary() -> str:
    """One line for the end of the test session: how many blocks there are and what happened to them."""
    per_doc = ", ".join(f"{d.relative_to(ROOT)} {len(docs_blocks.blocks(d))}" for d in docs_blocks.DOCUMENTS)
    kinds: dict[str, int] = {}
    for b in ALL:
        kinds[b.lang] = kinds.get(b.lang, 0) + 1
    skipped = [b for b in ALL if b.skip]
    promises = sum(docs_blocks.instrument(b)[1] for group in PYTHON for b in group)
    return (f"docs: {len(ALL)} fenced blocks ({per_doc}): "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + f"; {len(ALL) - len(skipped)} run or checked, {len(skipped)} skipped with a reason; "
            + f"{promises} promised results checked")
