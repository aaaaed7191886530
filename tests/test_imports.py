"""The project's modules import each other without cycles — counting the imports inside
functions too, since a lazy import that closes a loop is a layering mistake all the same (the
core reaching up into the cluster, the dataset code into the loader)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_folders() -> dict[str, Path]:
    """Import name -> folder, as setuptools installs them: ``interp_engine/`` plus every
    ``package-dir`` entry of pyproject.toml (``actors/`` and ``jobs/`` install under interp_engine)."""
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {"interp_engine": ROOT / "interp_engine", **{name: ROOT / folder for name, folder in mapping.items()}}


PACKAGES = source_folders()


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (``from pkg import mod`` counts
    as importing ``pkg.mod`` when that is a module, else ``pkg``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else (node.module or "")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle, each listed once from its smallest module name."""
    out = []

    def walk(start, node, path):
        for nxt in sorted(graph[node]):
            if nxt == start:
                out.append(path + [start])
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return out


def test_the_walker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    known = modules()
    assert "interp_engine.actors.replica" in known and "interp_engine.backends.eager.model" in known
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["interp_engine.loading"] >= {"interp_engine.local"}  # the walker reads relative imports
    found = [" -> ".join(c) for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


#: the floors of the library, lowest first: a module may import its own floor and the ones below,
#: never one above. Each floor is a list of module-name prefixes; a module sits on the floor of
#: its longest matching prefix, and the rest of interp_engine (addresses, edits, caches, family
#: records: code that runs in any process) is the core.
FLOORS = [
    ("core", ["interp_engine."]),
    ("backends", ["interp_engine.backends"]),  # eager in the caller; vllm's worker/ inside vLLM's workers
    ("dataset", ["interp_engine.dataset", "interp_engine.stream"]),  # stream: the dataset rows, without the disk
    ("actors", ["interp_engine.actors"]),  # Ray worker processes (package-dir: actors/)
    ("cluster", ["interp_engine.cluster", "interp_engine.service"]),  # the driver side of a cluster (creates the actors); the service
    ("entry", ["interp_engine", "interp_engine.loading", "interp_engine.jobs", "interp_engine.examples"]),
]


def floor(module: str) -> int:
    best, level = -1, 0
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            hit = module == prefix or module.startswith(prefix if prefix.endswith(".") else prefix + ".")
            if hit and len(prefix) > best:
                best, level = len(prefix), i
    return level


def test_the_floors_are_what_they_say():
    assert [floor(m) for m in ("interp_engine.address", "interp_engine.backends.vllm.worker.hooks",
                               "interp_engine.dataset.shard", "interp_engine.actors.replica",
                               "interp_engine.cluster.model", "interp_engine.loading", "interp_engine")] == [0, 1, 2, 3, 4, 5, 5]


def test_no_module_imports_from_a_higher_floor():
    """The engine works without Ray and a backend without datasets: the core imports no backend,
    a backend no dataset code, the dataset code neither actors nor the cluster, the actors not the
    driver-side cluster package. Only the entry points (``interp_engine/__init__``, ``load_model``,
    jobs, examples) see everything. Imports inside functions count: a lazy import is still a
    dependency, and the mapping of ``actors/`` and ``jobs/`` comes from pyproject.toml."""
    known = modules()
    upward = {}
    for name, path in known.items():
        above = sorted(t for t in imports(name, path, known) if floor(t) > floor(name))
        if above:
            upward[f"{name} ({FLOORS[floor(name)][0]})"] = [f"{t} ({FLOORS[floor(t)][0]})" for t in above]
    assert not upward, "imports from a higher floor:\n" + "\n".join(f"{k} -> {v}" for k, v in upward.items())


def test_every_package_is_installed():
    """pyproject.toml lists the packages setuptools installs: every folder of the library with an
    ``__init__.py`` is among them (a subpackage left out is missing from a wheel)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found - listed == set(), f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"


def test_readme_layout_names_every_library_module():
    """README's layout section is the map of the package: every module of interp_engine/ is
    named there, by its file name or a family pattern such as ``dataset_*.py``."""
    import fnmatch
    import re

    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    named = set(re.findall(r"[\w*]+\.py", layout))
    missing = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "interp_engine").rglob("*.py"))
               if path.name != "__init__.py" and not any(fnmatch.fnmatch(path.name, n) for n in named)]
    assert not missing, f"README.md's layout section does not name: {missing}"
