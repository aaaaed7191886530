"""The project's modules import each other without cycles — counting the imports inside
functions too, since a lazy import that closes a loop is a layering mistake all the same (the
core reaching up into the cluster, the dataset code into the loader)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: import name of each source folder (actors/ and jobs/ install under interp_engine)
PACKAGES = {"interp_engine": ROOT / "interp_engine", "interp_engine.actors": ROOT / "actors",
            "interp_engine.jobs": ROOT / "jobs"}


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
    assert "interp_engine.actors.replica" in known and "interp_engine.backends.eager" in known
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["interp_engine.loading"] >= {"interp_engine.local"}  # the walker reads relative imports
    found = [" -> ".join(c) for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


#: the core modules that may import the Ray actors: the cluster model (driver side) alone
TALKS_TO_ACTORS = {"interp_engine.cluster"}


def test_the_core_does_not_reach_up_into_the_actors():
    """The engine (backends, datasets, padding, dtypes) works without Ray: only the cluster model
    imports ``interp_engine.actors``; the actors build on the core, never the other way."""
    known = modules()
    core = {name: path for name, path in known.items()
            if not name.startswith(("interp_engine.actors", "interp_engine.jobs", "interp_engine.examples"))}
    upward = {name: sorted(t for t in imports(name, path, known) if t.startswith("interp_engine.actors"))
              for name, path in core.items() if name not in TALKS_TO_ACTORS}
    upward = {name: targets for name, targets in upward.items() if targets}
    assert not upward, f"core modules importing the actors: {upward}"


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
