"""The fenced code blocks of README.md and docs/*.md, as the docs test runs them.

A block is what a reader copies: it must run on its own, as written. Markers, on the line right
before a fence (an HTML comment, invisible on the rendered page):

- ``<!-- skip: reason -->``: listed and skipped with the reason (a benchmark; the suite itself);
- ``<!-- continues -->``: this python block runs after the previous python block of the same
  file, in the same process (a tutorial told over several blocks).

Hub ids that are not on this machine stand for a tiny model of the same family
(:data:`STANDINS`); the embedded SmolLM2's hub id loads offline as it is.

A python block states results two ways, and the runner checks both (:func:`instrument`):

- ``expr  # -> value  prose``: a promise that ``expr`` gives ``value`` (a Python literal, or an
  expression of literals and ``torch`` such as ``torch.Size([1, 5])``, whether or not the block
  imports torch; it ends at two spaces or the end of the line, and what follows is prose).
  A ``torch.Size`` or tuple equals the list of the same numbers (:func:`promised`);
- a bare comparison statement (``a == b``, ``x in y``), whose result a reader would otherwise
  take on trust, is asserted;
- ``name = expr  # [batch, pos, d_model]``: a shape stated with symbols (:func:`shaped`): the
  same number of axes; a number is that size; a symbol that is a size of ``model`` (``d_model``,
  ``n_layers``, ``n_experts``, …) is that size; any other symbol (``batch``, ``pos``) takes the
  size it first meets and keeps it for the rest of the blocks run together.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: hub id in a doc -> tiny fixture family that stands in for it
STANDINS = {"Qwen/Qwen3-30B-A3B": "qwen3_moe"}

FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*(skip|continues)\s*:?\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None
    continues: bool = False

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with its markers; an unclosed fence is an error."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        ticks, lang = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a ``` fence that is never closed")
        marker = MARKER.match(lines[i - 1]) if i else None
        block = Block(path, i + 1, lang or "text", "\n".join(lines[i + 1 : end]) + "\n")
        if marker and marker.group(1) == "skip":
            block.skip = marker.group(2) or "no reason given"
        elif marker:
            block.continues = True
        found.append(block)
        i = end + 1
    return found


def fence_count(path: Path) -> int:
    """Fences counted the naive way, to check the parser found every block."""
    return sum(1 for line in path.read_text().splitlines() if line.startswith("```")) // 2


def python_groups(found: list[Block]) -> list[list[Block]]:
    """Python blocks grouped so that a ``continues`` block runs after the ones before it."""
    groups: list[list[Block]] = []
    for block in found:
        if block.lang != "python":
            continue
        if block.continues and groups:
            groups[-1].append(block)
        else:
            groups.append([block])
    return groups


def command_key(code: str) -> str:
    """A bash block's commands without comments or blank lines: two docs that show the same
    commands run them once."""
    kept = []
    for line in code.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line:
            kept.append(" ".join(line.split()))
    return "\n".join(kept)


PROMISE = re.compile(r"^(?P<indent>\s*)(?P<expr>\S.*?)\s*#\s*->\s*(?P<value>.*?)\s*$")
SHAPE = re.compile(r"^(?P<indent>\s*)(?P<target>[A-Za-z_]\w*)\s*=\s*(?P<expr>[^#]*?)\s*"
                   r"#\s*\[(?P<dims>\s*\w+(?:\s*,\s*\w+)*\s*)\](?:\s{2,}.*)?\s*$")


def instrument(block: Block) -> tuple[str, int]:
    """``block.code`` with each promise and bare comparison turned into a check that names the
    doc line, and the number of checks; the lines keep their numbers. A ``# ->`` that does not
    follow an expression or give a value is an error naming the line."""
    lines = block.code.splitlines()
    checks = 0
    for i, line in enumerate(lines):
        found = PROMISE.match(line)
        if not found:
            continue
        expr, value = found["expr"], re.split(r"\s{2,}", found["value"], maxsplit=1)[0]
        where = f"{block.path.relative_to(ROOT)}:{block.line + 1 + i}"
        try:
            ast.parse(expr, mode="eval"), ast.parse(value, mode="eval")
        except SyntaxError:
            raise ValueError(f"{where}: a '# ->' promise must follow an expression and give a Python value: "
                             f"{line.strip()!r}") from None
        lines[i] = f"{found['indent']}__promised__({expr}, {value!r}, {where + ': ' + expr!r})"
        checks += 1
    for i, line in enumerate(lines):
        found = SHAPE.match(line)
        if found:
            where = f"{block.path.relative_to(ROOT)}:{block.line + 1 + i}: {found['target']}"
            lines[i] = (f"{found['indent']}{found['target']} = __shaped__({found['expr']}, {found['dims']!r}, "
                        f"{where!r}, globals())")
            checks += 1
    tree = ast.parse("\n".join(lines))
    claims = [node for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Compare)]
    for node in sorted(claims, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        where = f"{block.path.relative_to(ROOT)}:{block.line + node.lineno}"
        message = f"{where}: {ast.get_source_segment(chr(10).join(lines), node.value)} is false"
        end = lines[node.end_lineno - 1]
        lines[node.end_lineno - 1] = f"{end[:node.end_col_offset]}, {message!r}{end[node.end_col_offset:]}"
        start = lines[node.lineno - 1]
        lines[node.lineno - 1] = f"{start[:node.col_offset]}assert {start[node.col_offset:]}"
        checks += 1
    return "\n".join(lines) + "\n", checks


def promised(got, value: str, where: str) -> None:
    """The check behind ``expr  # -> value``: ``value`` is evaluated with only ``torch`` in scope;
    sequences (``torch.Size``, tuples, lists, tensors) compare element by element, anything else
    with ``==``."""
    import torch

    value = eval(value, {"torch": torch})
    if not _same(got, value):
        raise AssertionError(f"{where}: the doc promises {value!r}, the code gives {got!r}")


def shaped(value, dims: str, where: str, namespace: dict):
    """The check behind ``name = expr  # [dims]`` (see the module docstring); gives ``value``."""
    shape, names = list(value.shape), [d.strip() for d in dims.split(",")]
    said = f"{where}: the doc says [{dims}], the code gives {shape}"
    if len(shape) != len(names):
        raise AssertionError(said)
    bound = namespace.setdefault("__shape_symbols__", {})
    model = namespace.get("model")
    for name, size in zip(names, shape):
        sizes = [getattr(owner, name, None) for owner in (model, getattr(model, "info", None))]
        known = next((v for v in sizes if isinstance(v, int) and not isinstance(v, bool)), None)
        want = int(name) if name.isdigit() else known if known is not None else bound.setdefault(name, size)
        if size != want:
            raise AssertionError(f"{said} ({name} = {want})")
    return value


def _same(got, value) -> bool:
    if hasattr(got, "tolist") and not isinstance(got, (str, bytes)):
        got = got.tolist()
    if isinstance(value, (list, tuple)):
        return (isinstance(got, (list, tuple)) and len(got) == len(value)
                and all(_same(g, v) for g, v in zip(got, value)))
    if isinstance(got, bool) or isinstance(value, bool):
        return got is value
    return got == value
