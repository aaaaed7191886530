"""The fenced code blocks of README.md and docs/*.md, as the docs test runs them.

A block is what a reader copies: it must run on its own, as written. Markers, on the line right
before a fence (an HTML comment, invisible on the rendered page):

- ``<!-- skip: reason -->``: listed and skipped with the reason (a benchmark; the suite itself);
- ``<!-- continues -->``: this python block runs after the previous python block of the same
  file, in the same process (a tutorial told over several blocks).

Hub ids that are not on this machine stand for a tiny model of the same family
(:data:`STANDINS`); the embedded SmolLM2's hub id loads offline as it is.
"""

from __future__ import annotations

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
