"""The fenced blocks of README.md and docs/*.md: their language, their commands and their `not run` markers.

Every fence names its language (`text` for output, listings and diagrams). A block of a shell (bash, sh, shell,
console) or of Python is run (the shell's by tests/integration/test_documented_commands_integration.py, Python's
by tests/unit/house/test_documented_commands.py) unless the line just before its fence is `<!-- not run: WHY -->`
(an HTML comment: the rendered page does not show it), WHY saying why it cannot be.
docs/history/ is a dated log of past measurements, quoted as they were run, and is left out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
PYTHON = ("python", "py")
MARKER = re.compile(r"<!--\s*not run\b")  # what starts a marker, well formed or not
WELL_FORMED = re.compile(r"<!-- not run: (?P<why>\S.*?) -->")


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # continuation lines joined, as bash reads them


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # the opening fence's
    lang: str  # the fence's info string's first word; "" when it has none
    body: tuple[str, ...]  # the lines between the fences, less the fence's indentation
    marker: str | None  # the line just before the fence when it is a `not run` marker

    @property
    def not_run(self) -> str | None:
        """Why the block is not run (None: it is run, or it has no marker)."""
        found = WELL_FORMED.fullmatch(self.marker.strip()) if self.marker else None
        return found["why"].strip() if found else None

    def commands(self) -> list[Command]:
        """A shell block's commands: comments and blank lines left out, a `\\` line joined to the next; in a
        `console` block only the lines after a `$ ` prompt."""
        out, pending, start = [], "", 0
        for n, raw in enumerate(self.body, self.line + 1):
            line = raw.strip()
            if self.lang == "console" and not pending:
                if not line.startswith("$ "):
                    continue
                line = line[2:].strip()
            if not pending and (not line or line.startswith("#")):
                continue
            start = start if pending else n
            pending = f"{pending} {line[:-1].strip()}" if line.endswith("\\") else f"{pending} {line}"
            if not line.endswith("\\"):
                out.append(Command(self.doc, start, pending.strip()))
                pending = ""
        return out


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path`, in order."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    opened: tuple[int, str, int] | None = None  # (index, info string, indentation) of the open fence
    for i, raw in enumerate(lines):
        if not raw.strip().startswith("```"):
            continue
        if opened is None:
            opened = (i, raw.strip()[3:].strip(), len(raw) - len(raw.lstrip()))
            continue
        start, info, indent = opened
        before = lines[start - 1] if start else ""
        found.append(
            Block(
                doc=path.name,
                line=start + 1,
                lang=info.split()[0] if info else "",
                body=tuple(
                    line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[start + 1 : i]
                ),
                marker=before if MARKER.match(before.strip()) else None,
            )
        )
        opened = None
    if opened is not None:
        found.append(Block(path.name, opened[0] + 1, "unclosed", (), None))
    return found


def problems(path: Path) -> list[str]:
    """What breaks the rules of the module docstring in `path`: a fence without a language or never closed, a
    marker without a reason, a marker on a block that is neither shell nor Python or that precedes no fence."""
    found = []
    marked = set()
    for b in blocks(path):
        where = f"{b.doc}:{b.line}"
        if b.lang == "unclosed":
            found.append(f"{where}: a fence that is never closed")
        elif not b.lang:
            found.append(f"{where}: a fence without a language (```bash, ```python, ```text, ...)")
        if b.marker is not None:
            marked.add(b.line - 1)
            if b.not_run is None:
                found.append(f"{where}: a marker without a reason ({b.marker.strip()}): `<!-- not run: WHY -->`")
            elif b.lang not in SHELL + PYTHON:
                found.append(f"{where}: a `not run` marker on a ```{b.lang} block, which is never run")
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if MARKER.match(line.strip()) and n not in marked:
            found.append(f"{path.name}:{n}: a `not run` marker that is not on the line just before a fence")
    return found


def run_python(block: Block, folder: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run a Python block as a script in `folder`, with this checkout on PYTHONPATH."""
    script = folder / f"{Path(block.doc).stem}_{block.line}.py"
    script.write_text("\n".join(block.body) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, script.name],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
