"""Every module path the docs, the images' files, the docstrings and the comments name exists in the tree.

A module is named dotted (`lmyard.launch.torchrun`, `lmyard.checkpoint.manager.CheckpointManager`: the module,
then a name it defines) or as a path (`lmyard/launch/torchrun.py`, `lmyard/train/`), or in a tree listing of a
docs page's fenced block (a folder line `lmyard/train/`, then its files indented beneath). A dotted name counts
as a module's when its second part names a module or package of the tree, here or anywhere (`lmyard.images`
for lmyard.launch.images); `lmyard.attempt.N` is an MLflow tag.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from conftest import REPO

DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted(p for p in (REPO / "images").iterdir() if p.is_file()),
]
CODE = [p for folder in ("lmyard", "flows", "tasks", "tests") for p in sorted((REPO / folder).rglob("*.py"))]
# files that name what does not exist on purpose (the habits test's gone entry points; this test's samples)
NAMES_ABSENT_ON_PURPOSE = {REPO / "tests" / "unit" / "house" / "test_habits.py", Path(__file__).resolve()}
# dotted names under a module's name that are no module's: MLflow tags, Prefect resource ids
NOT_MODULES = {
    "lmyard.evaluations",  # the evaluations' MLflow table
    "lmyard.gates",  # the tag and Prefect event of a registered version's gates
    "lmyard.model",  # a registered version's Prefect resource id
    "lmyard.stage",  # a stage container's Docker label
    "lmyard.sweep.kind",
    "lmyard.sweep.stopped_at_step",
}
# paths that are not the repository's: a site's own recipes (in the folder lmyard runs from), an MLflow artifact
NOT_OURS = {"deploy/recipes/", "lmyard/checkpoints.json"}
# the name of every module and package of the tree: `lmyard.NAME` with NAME among them names a module
STEMS = {
    p.stem if p.suffix else p.name
    for folder in ("lmyard", "flows", "tasks")
    for p in (REPO / folder).rglob("*")
    if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
}

DOTTED = re.compile(r"(?<![\w./-])((?:lmyard|flows|tasks)(?:\.\w+)+)(?![\w-])")  # `lmyard.build-stage`: a label
SLASHED = re.compile(r"(?<![\w./-])((?:lmyard|flows|tasks|tests|images|deploy)/[\w./-]*\w/?)")


@functools.cache
def defined_names(module: Path) -> frozenset[str]:
    """Every name a module defines or imports, at any depth (a class's methods included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def dotted_exists(name: str, root: Path = REPO) -> bool:
    """`a.b.c.d`: the longest prefix that is a module or package, then (if anything is left) a name it defines."""
    parts = name.split(".")
    second = root / parts[0] / parts[1]
    if any(name == n or name.startswith(n + ".") for n in NOT_MODULES):
        return True
    if not (second.is_dir() or second.with_suffix(".py").is_file()):
        return parts[1] not in STEMS  # a tag, a metric; or a module's name in the wrong place
    for i in range(len(parts), 1, -1):
        base = root.joinpath(*parts[:i])
        module = next((m for m in (base.with_suffix(".py"), base / "__init__.py") if m.is_file()), None)
        if module is not None:
            return i == len(parts) or parts[i] in defined_names(module)
        if base.is_dir() and i == len(parts):
            return True
    return False


def tree_listing_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of each file of a tree listing in a fenced block: a folder line `lmyard/train/`, then files
    indented beneath it (`  trainer.py ...`), a subfolder (`  distributed/  group.py ...`) naming its own."""
    found, fenced, folder, sub = [], False, None, None
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced, folder = not fenced, None
            continue
        if not fenced:
            continue
        if m := re.fullmatch(r"((?:lmyard|flows|tasks|tests)/[\w/]*)\s*", line):
            folder, sub = m.group(1).rstrip("/") + "/", None
        elif folder and (m := re.match(r"^  (\w+\.py|\w+/)(?:\s|$)", line)):
            name = m.group(1)
            sub = name if name.endswith("/") else None
            found.append((n, folder + name))
            rest = line[m.end() :] if sub else ""
            found += [(n, folder + sub + f) for f in re.findall(r"\b(\w+\.py)\b", rest)] if sub else []
        elif folder and sub and line.startswith("   "):
            found += [(n, folder + sub + f) for f in re.findall(r"\b(\w+\.py)\b", line)]
        elif folder and not line.startswith("  "):
            folder = None
    return found


def missing_names(path: Path, text: str, root: Path = REPO, docs: bool = True) -> list[str]:
    """`path:line: name` of each module path `text` names that `root` does not hold. Docs are checked for any
    path of the tree; code (docs=False) for dotted names and `.py` paths only (its other paths are data)."""
    missing = []
    where = path.relative_to(root) if path.is_relative_to(root) else path
    for n, line in enumerate(text.splitlines(), 1):
        for name in DOTTED.findall(line):
            if not dotted_exists(name.rstrip("."), root):
                missing.append(f"{where}:{n}: {name}")
        for name in SLASHED.findall(line):
            if name in NOT_OURS or any(part.isupper() for part in re.split(r"[/.]", name)):  # a placeholder: RUN
                continue
            if not docs and not name.endswith(".py"):
                continue
            if not ((root / name).exists() or (path.parent / name).exists()):
                missing.append(f"{where}:{n}: {name}")
    if docs:
        missing += [f"{where}:{n}: {p}" for n, p in tree_listing_paths(text) if not (root / p).exists()]
    return missing


def test_every_module_the_docs_and_the_images_files_name_exists():
    missing = [m for doc in DOCS for m in missing_names(doc, doc.read_text())]
    assert not missing, "the docs name modules or files that do not exist (moved? fix the name):\n" + "\n".join(missing)


def test_every_module_the_docstrings_and_comments_name_exists():
    code = [p for p in CODE if p not in NAMES_ABSENT_ON_PURPOSE]
    missing = [m for p in code for m in missing_names(p, p.read_text(), docs=False)]
    assert not missing, "docstrings or comments name modules that do not exist (moved? fix the name):\n" + "\n".join(
        missing
    )


def test_the_scan_finds_stale_dotted_slashed_and_listed_names_and_leaves_tags(tmp_path):
    (tmp_path / "lmyard" / "train").mkdir(parents=True)
    (tmp_path / "lmyard" / "__init__.py").write_text("")
    (tmp_path / "lmyard" / "train" / "__init__.py").write_text("")
    (tmp_path / "lmyard" / "train" / "trainer.py").write_text("class Trainer:\n    def train(self):\n        pass\n")
    doc = tmp_path / "page.md"
    text = (
        "`lmyard.train.trainer.Trainer`, `lmyard.train.trainer.train` and lmyard/train/trainer.py hold; the tag\n"
        "`lmyard.attempt.N` and `runs/RUN/` are no modules. Stale: `lmyard.train.loop`, lmyard/train/loop.py,\n"
        "`lmyard.train.trainer.main`, lmyard/launch/, `lmyard.trainer.Trainer` (in the wrong place).\n"
        "```\n"
        "lmyard/train/\n"
        "  trainer.py    the loop\n"
        "  startup.py    gone\n"
        "```\n"
    )
    found = [m.split(": ", 1)[1] for m in missing_names(doc, text, tmp_path)]
    assert found == [
        "lmyard.train.loop",
        "lmyard/train/loop.py",
        "lmyard.train.trainer.main",
        "lmyard.trainer.Trainer",
        "lmyard/launch/",
        "lmyard/train/startup.py",
    ]
