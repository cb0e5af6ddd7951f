"""The import direction of docs/architecture.md: lmyard never imports prefect; flows never import torch; no import cycle
among lmyard's modules; no module imports a part above its own in docs/architecture.md's layer order; only
lmyard.layout formats store keys."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO


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


# ---------------------------------------------------------------- store keys: lmyard.layout owns them

_KEY = re.compile(r"(^|[/{}])(runs|shards)/")
_NOT_A_KEY = "# not a store key"  # a line comment for a string that only looks like one (an MLflow artifact path)


def _literal_text(node: ast.AST) -> str | None:
    """The literal text of a str constant, or of an f-string with `{}` for each placeholder."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def store_keys_formatted(path: Path) -> list[str]:
    """`path:line text` for each string in `path` that formats a `runs/` or `shards/` key: a string or an
    f-string with `runs/` or `shards/` at its start or after a `/` or a placeholder, and no spaces (prose
    that names a key, help texts and docstrings have spaces; a key has none)."""
    source = path.read_text()
    tree, lines = ast.parse(source), source.splitlines()
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    in_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        text = _literal_text(node)
        if text is None or id(node) in docstrings or id(node) in in_fstring or " " in text:
            continue
        if _KEY.search(text) and _NOT_A_KEY not in lines[node.lineno - 1]:
            found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno} {text!r}")
    return sorted(found, key=lambda f: int(f.split()[0].rsplit(":", 1)[1]))


def test_key_scan_sees_keys_in_strings_and_fstrings(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Docstring naming runs/<run>/lease.json."""\n'
        'a = f"runs/{name}/lease.json"\n'
        'b = "shards/" + address\n'
        'c = f"{root}/shards/{address}"\n'
        'd = f"see runs/{name} in the store"\n'
        'e = "shards/manifest.json"  # not a store key\n'
        'f = "dataruns/x"\n'
    )
    found = store_keys_formatted(sample)
    assert [f.split()[0].rsplit(":", 1)[1] for f in found] == ["2", "3", "4"], found


def test_only_layout_formats_store_keys():
    found = [
        hit
        for folder in ("lmyard", "flows", "tasks")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != REPO / "lmyard" / "layout.py"
        for hit in store_keys_formatted(path)
    ]
    assert not found, "format store keys with lmyard.layout (RunLayout, ShardLayout) only:\n" + "\n".join(found)


# ---------------------------------------------------------------- import cycles and the layer order


def module_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside functions. Importing
    `a.b.c` imports `a.b` too (its __init__ runs), so `from a.b import c` is an edge to both."""
    mods = {}
    for p in package.rglob("*.py"):
        name = ".".join(p.relative_to(package.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        is_package = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package (a package's own __init__ is its package)
                    parts = m.split(".")[: len(m.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_cycle_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    import pkg.a\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    graph = module_graph(pkg)
    assert graph["pkg.sub"] == {"pkg.sub.b"} and "pkg.a" in graph["pkg.c"]
    assert import_cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]


def test_no_import_cycles_among_lmyard_modules():
    cycles = import_cycles(module_graph(REPO / "lmyard"))
    assert not cycles, "import cycles (imports inside functions count): move the shared part down a layer: " + (
        "; ".join(" <-> ".join(c) for c in cycles)
    )


def layer_order() -> dict[str, int]:
    """The layer order of docs/architecture.md (its `### Layer order` numbered list, bottom first):
    top-level module or package of lmyard (or a module of one, `stages.entry`) -> rank; names on one line share
    a rank."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("### Layer order", 1)[1].split("\n#", 1)[0]
    ranks = {}
    for rank, line in enumerate(re.findall(r"^\d+\. (.+)$", section, flags=re.M)):
        for name in re.findall(r"`([a-z_.]+)`", line.split(":")[0]):
            ranks[name] = rank
    return ranks


def _unit(module: str, ranks: dict[str, int]) -> str:
    """`lmyard.data.shards` -> `data`; a module the layer order names itself (`stages.entry`) is its own part;
    the package's own __init__ (`lmyard`) is below everything."""
    parts = module.split(".")[1:]
    named = [".".join(parts[:n]) for n in range(len(parts), 1, -1) if ".".join(parts[:n]) in ranks]
    return named[0] if named else parts[0] if parts else "lmyard"


def test_layer_order_names_every_part_of_lmyard():
    ranks = layer_order()
    units = {_unit(m, ranks) for m in module_graph(REPO / "lmyard")} - {"lmyard"}
    assert units <= set(ranks), f"docs/architecture.md's layer order lacks {sorted(units - set(ranks))}"
    assert set(ranks) <= units, f"docs/architecture.md's layer order names what is gone: {sorted(set(ranks) - units)}"


def upward_imports() -> list[str]:
    """`importer -> imported` for each lmyard module that imports a part above its own in the layer order."""
    ranks = {**layer_order(), "lmyard": -1}
    return sorted(
        f"{m} -> {t}"
        for m, targets in module_graph(REPO / "lmyard").items()
        for t in targets
        if ranks.get(_unit(t, ranks), -1) > ranks.get(_unit(m, ranks), -1)
    )


def test_no_lmyard_module_imports_a_layer_above_its_own():
    upward = upward_imports()
    assert not upward, "imports against docs/architecture.md's layer order:\n" + "\n".join(upward)


# parts the order puts one above the other that import nothing of each other (docs/architecture.md says which):
# a helper both need lives in a layer below them (a file's sha256 in lmyard.paths, the autocast in lmyard.models)
SIBLINGS = [("checkpoint", "data")]


def part_imports(graph: dict[str, set[str]], importer: str, imported: str) -> list[str]:
    """`module -> module` for each import of a module of part `imported` by one of part `importer`."""
    ranks = layer_order()
    return sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        for t in ts
        if _unit(m, ranks) == importer and _unit(t, ranks) == imported
    )


@pytest.mark.parametrize("a,b", SIBLINGS, ids=["-".join(s) for s in SIBLINGS])
def test_sibling_parts_import_nothing_of_each_other(a, b):
    graph = module_graph(REPO / "lmyard")
    found = part_imports(graph, a, b) + part_imports(graph, b, a)
    assert not found, f"{a} and {b} import each other (move what both need below them):\n" + "\n".join(found)


def test_the_training_forwards_autocast_is_the_models_not_the_evaluators():
    graph = module_graph(REPO / "lmyard")
    assert part_imports(graph, "train", "evaluate") == ["lmyard.train.trainer -> lmyard.evaluate.validation"]
    assert "lmyard.models.base" in graph["lmyard.train.distributed.parallelism"]


# ---------------------------------------------------------------- the run handle: one door to a lineage's state


def store_and_name_pairs(path: Path) -> list[str]:
    """`path:line name` of each function of `path` that takes both a store (a parameter `store`, or one annotated
    `Store`) and a run name (`run_name`): such a function takes the run's handle (lmyard.run.Run) instead."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            store = any(a.arg == "store" or (a.annotation and ast.unparse(a.annotation) == "Store") for a in params)
            if store and any(a.arg == "run_name" for a in params):
                found.append(
                    f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno} {node.name}"
                )
    return found


def test_pair_scan_sees_a_store_beside_a_run_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def a(store, run_name, step): ...\n"
        "def b(run, step): ...\n"
        "class C:\n    def __init__(self, s: Store, *, run_name: str): ...\n"
        "def d(store, name): ...\n"
    )
    assert [f.split()[1] for f in store_and_name_pairs(sample)] == ["a", "__init__"]


def test_no_function_takes_a_store_and_a_run_name_apart():
    found = [
        hit
        for folder in ("lmyard", "flows", "tasks")
        for p in sorted((REPO / folder).rglob("*.py"))
        for hit in store_and_name_pairs(p)
    ]
    assert not found, "take the run's handle (lmyard.run.Run: run.store, run.name, run.layout):\n" + "\n".join(found)


def test_a_lineages_layout_is_made_only_by_its_handle():
    made = [
        f"{p.relative_to(REPO)}:{i}"
        for folder in ("lmyard", "flows", "tasks")
        for p in sorted((REPO / folder).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "RunLayout(" in line and p.name != "layout.py"
    ]
    assert len(made) == 1 and made[0].startswith("lmyard/run.py:"), (
        "make a lineage's keys with its handle (run.layout), not RunLayout(...):\n" + "\n".join(made)
    )
