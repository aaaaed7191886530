"""The vLLM adapter (interp_engine/backends/vllm/compat.py): the one module that names vLLM's
private structure. It refuses a vLLM release it was not written for, no other module of the
project reaches into vLLM's private attributes, and its reads agree with the Hugging Face model
on the same weights."""

from __future__ import annotations

import importlib.util
import io
import re
import sys
import tokenize
import types
from pathlib import Path

import pytest
import torch

from .. import tiny

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "interp_engine" / "backends" / "vllm" / "compat.py"

#: vLLM's private structure that the project relies on, as attribute names: only the adapter may
#: name them (a new vLLM release then means reviewing one file)
PRIVATE = (
    "input_batch", "query_start_loc", "compute_logits", "model_runner", "model_config",
    "num_kv_heads", "head_size", "input_size_per_partition", "params_dtype", "embedding_dim",
    "quant_method", "is_monolithic", "routed_experts", "select_experts", "router",
    "_finalizer", "engine_core", "structured_output_manager", "model_executor", "scheduler",
    "disable_envs_cache", "get_tensor_model_parallel_rank", "_C", "kv_caches", "kv_cache_config", "block_ids",
    "num_computed_tokens", "kv_cache_groups", "kv_cache_spec", "request_block_hasher", "hash_block_size",
    "block_hashes",
)


def _load_adapter_with(version: str):
    """Import a fresh copy of the adapter against a fake ``vllm`` reporting ``version``."""
    fake = types.ModuleType("vllm")
    fake.__version__ = version
    spec = importlib.util.spec_from_file_location("_vllm_compat_probe", ADAPTER)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "interp_engine.backends"  # its relative imports (the errors) resolve as in the package
    saved = sys.modules.get("vllm")
    sys.modules["vllm"] = fake
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("vllm", None)
        else:
            sys.modules["vllm"] = saved
    return module


def test_an_unsupported_vllm_is_refused_with_what_to_do():
    with pytest.raises(ImportError) as err:
        _load_adapter_with("0.33.1")
    message = str(err.value)
    assert "vLLM 0.33.1 is installed" in message and "0.32.x" in message
    assert "pip install 'vllm==0.32.*'" in message and "backend='eager'" in message
    with pytest.raises(ImportError, match="vLLM 0.3.2 is installed"):
        _load_adapter_with("0.3.2")


def test_supported_releases_load():
    for version in ("0.32.0", "0.32.1", "0.32.0+cpu"):
        assert _load_adapter_with(version).SUPPORTED == "0.32"


def _code_lines(path: Path) -> list[str]:
    """The file's lines; in a family record (``interp_engine/archs/``) without its strings, which are
    module paths of the model's own tree (GPT-OSS's ``"mlp.router"`` names a submodule, as
    ``"mlp.gate"`` does elsewhere): that data is what the records exist to hold, not a reach into
    vLLM's private attributes."""
    text = path.read_text()
    if "archs" not in path.relative_to(ROOT).parts:
        return text.splitlines()
    lines = text.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.STRING, tokenize.COMMENT) or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            (start_row, start_col), (end_row, end_col) = token.start, token.end
            for row in range(start_row, end_row + 1):
                line = lines[row - 1]
                first = start_col if row == start_row else 0
                last = end_col if row == end_row else len(line)
                lines[row - 1] = line[:first] + " " * (last - first) + line[last:]
    return lines


def test_no_other_module_names_vllm_private_attributes():
    pattern = re.compile(r"(?<![\w])(\w+)\.(" + "|".join(map(re.escape, PRIVATE)) + r")\b")
    found = []
    for folder in ("interp_engine", "actors", "jobs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ADAPTER:
                continue
            for number, line in enumerate(_code_lines(path), 1):
                code = line.split("#", 1)[0]
                for match in pattern.finditer(code):
                    owner, name = match.groups()
                    if owner == "vllm_compat" or (owner == "self" and name.startswith("_")):
                        continue  # the adapter's own functions; this project's own private state
                    found.append(f"{path.relative_to(ROOT)}:{number}: {owner}.{name}")
    assert not found, "vLLM internals outside backends/vllm/compat.py:\n" + "\n".join(found)


def test_no_module_reads_the_worker_recorders_private_state():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "interp_engine").rglob("*.py")
                 if re.search(r"\brecorder\._\w", p.read_text())]
    assert not offenders, offenders


def test_moe_selection_and_monolithic_detection():
    pytest.importorskip("vllm")
    from interp_engine.backends.vllm import compat as vllm_compat

    router = types.SimpleNamespace(select_experts=lambda *a: None)
    modular = types.SimpleNamespace(router=router, routed_experts=types.SimpleNamespace(
        quant_method=types.SimpleNamespace(is_monolithic=False)))
    assert vllm_compat.moe_selection(modular) == (router, "select_experts")
    assert not vllm_compat.moe_is_monolithic(modular)
    modular.routed_experts.quant_method.is_monolithic = True
    assert vllm_compat.moe_is_monolithic(modular)
    assert vllm_compat.moe_selection(types.SimpleNamespace()) is None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pytest.importorskip("vllm")
    from interp_engine import load_model

    path = str(tiny.build("llama", tmp_path_factory.mktemp("compat")))
    model = load_model(path, backend="vllm", max_model_len=64)
    yield model, load_model(path, backend="eager")
    model.close()


def test_reads_on_an_engine_agree_with_the_hf_model(pair):
    from interp_engine.backends.vllm.loop import run_on_loop

    vllm, eager = pair
    (geometry,) = run_on_loop(vllm._loop, "interp_geometry", vllm.arch.vllm_attention)
    assert geometry == {"heads": vllm.info.n_heads, "kv_heads": vllm.info.n_kv_heads, "head_size": vllm.info.d_head}
    hf_layer = eager.hf.get_submodule(eager.arch.layers)[1]
    torch.testing.assert_close(vllm.o_proj_weight(1), hf_layer.self_attn.o_proj.weight.detach(), rtol=0, atol=0)
    (unembedding,) = run_on_loop(vllm._loop, "interp_unembedding", "model.norm", ["lm_head", "model.embed_tokens"])
    hf_head = eager.hf.get_output_embeddings().weight.detach()
    torch.testing.assert_close(unembedding["weight"][: hf_head.shape[0]], hf_head, rtol=0, atol=0)


def test_kv_cache_reads_the_guard_relies_on(pair):
    """One KV cache view per attention layer, the scheduler's block on dim 0; the blocks of a
    request that is not scheduled are none; the engine's guard is installed from the start."""
    from interp_engine.backends.vllm import compat as vllm_compat

    from ..probes import engine_state

    vllm, _ = pair

    def look(worker):
        runner = vllm_compat.worker_runner(worker)
        views = vllm_compat.kv_cache_views(runner)
        return len(views), {view.shape[0] for view in views}, vllm_compat.request_block_ids(runner, "no such request")

    (layers, blocks, held), = vllm._loop.call(look).result()
    assert layers == vllm.info.n_layers and len(blocks) == 1 and held == []
    assert isinstance(engine_state(vllm)[0]["kv_blocks_zeroed"], int)
