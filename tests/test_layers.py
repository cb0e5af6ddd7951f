"""The import direction of DESIGN.md: lmyard never imports prefect; flows never import torch."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imports(folder: str) -> dict[str, set[str]]:
    found = {}
    for path in (REPO / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO))] = names
    return found


def test_library_never_imports_prefect():
    offenders = [p for p, names in _imports("lmyard").items() if "prefect" in names]
    assert not offenders, f"lmyard/ must not import prefect: {offenders}"


def test_flows_never_import_torch():
    offenders = [p for p, names in _imports("flows").items() if "torch" in names]
    assert not offenders, f"flows/ must not import torch: {offenders}"


def test_library_never_imports_flows_or_tasks():
    offenders = [p for p, names in _imports("lmyard").items() if names & {"flows", "tasks"}]
    assert not offenders, f"lmyard/ must not import flows/ or tasks/: {offenders}"


def test_checker_sees_imports_inside_functions():
    assert "prefect" in _imports("tasks")["tasks/shard.py"]


def test_importing_every_flow_and_task_loads_no_torch_transitively():
    import subprocess
    import sys

    modules = sorted(
        f"{p.parent.name}.{p.stem}"
        for folder in ("flows", "tasks")
        for p in (REPO / folder).glob("*.py")
        if p.stem != "__init__"
    )
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing flows/ and tasks/ loads torch into the flow process"
