"""A backend is described by what it can do (:mod:`interp_engine.capabilities`); the core reads
those fields and never asks a backend's name. The first test walks the core's syntax trees, so a
new ``if backend == "vllm"`` fails here instead of growing a seventh place to edit."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from interp_engine import Address, AddressError, InputError, Zero
from interp_engine.points import ModelInfo, all_points, check_points
from interp_engine.capabilities import LOADERS, Capabilities, backend_class
from interp_engine.edits import check_edits

ROOT = Path(__file__).resolve().parents[1]
#: where a backend's name may appear: the backends themselves, the registry, and the examples
EXEMPT = ("interp_engine/backends/", "interp_engine/capabilities.py", "interp_engine/examples/")


def core_files() -> list[Path]:
    files = [*(ROOT / "interp_engine").rglob("*.py"), *(ROOT / "actors").rglob("*.py")]
    return [p for p in files if not str(p.relative_to(ROOT)).startswith(EXEMPT)]


def _names_backend(node) -> bool:
    if isinstance(node, ast.Constant) and node.value in LOADERS:
        return True
    return isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")) == "backend"


def name_tests(tree: ast.AST) -> list[int]:
    """Lines that compare a backend's name, or key a table by backend names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_backend(o) for o in operands) and any(
                    isinstance(o, ast.Constant) and o.value in LOADERS for o in operands):
                found.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in LOADERS for k in node.keys):
            found.append(node.lineno)
    return found


def test_the_walker_sees_a_name_test():
    tree = ast.parse('if model.backend == "vllm": pass\nx = "eager" != backend\nW = {"eager": 1}\nok = backend')
    assert name_tests(tree) == [1, 2, 3]


def test_no_core_module_compares_a_backend_name():
    files = core_files()
    assert any(p.name == "address.py" for p in files) and any(p.name == "replica.py" for p in files)
    found = [f"{p.relative_to(ROOT)}:{line}" for p in files for line in name_tests(ast.parse(p.read_text()))]
    assert not found, ("these core lines decide by a backend's name; read a Capabilities field instead "
                       f"(interp_engine/capabilities.py): {found}")


INFO = ModelInfo("m", n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, d_head=4, d_mlp=16, d_vocab=10, n_ctx=32)


def test_a_new_backend_is_a_declaration():
    """A backend the core has never heard of is checked by what it declares."""
    dense = Capabilities("toy", "a toy engine", forms_pattern=False, writable=frozenset({"resid_post"}),
                         unserved=frozenset({"mlp_post"}))
    served = {a.name for a in all_points(INFO, dense)}
    assert "pattern" not in served and "mlp_post" not in served and "z" in served
    with pytest.raises(AddressError, match="the toy backend never forms it"):
        check_points(["pattern.0"], INFO, dense)
    assert check_points(["pattern.0"], INFO, Capabilities("toy2")) == [Address("pattern", 0)]
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(AddressError, match=r"cannot be edited on the toy backend \(a toy engine never forms"):
        check_edits({"pattern.0": Zero()}, INFO, dense, tokens)
    with pytest.raises(InputError, match="a Python function is an edit"):
        check_edits({"resid_post.0": lambda x, a: x}, INFO, dense, tokens)
    assert set(check_edits({"resid_post.0": Zero()}, INFO, dense, tokens)) == {Address("resid_post", 0)}


def test_the_registry_finds_every_backend_by_name():
    for name in LOADERS:
        cls = backend_class(name)
        assert cls.capabilities.name == name and callable(cls.load) and callable(cls.capabilities_for)
    with pytest.raises(ValueError, match="eager, vllm"):
        backend_class("tpu")
