"""Habits the tools hold the code to (lmyard/, flows/, tasks/), read from the source with ast:

- no reach into other projects' internals: no `subprocess.Popen` swapped, no torch elastic `PContext` patched,
  no private (`_`-prefixed) name of mlflow or prefect; the private names of torch kept for speed
  are listed here, and each is looked up, so a torch that moves one fails here rather than in a run;
- functions of at most MAX_FUNCTION_LINES lines and MAX_PARAMETERS parameters, modules of at most
  MAX_MODULE_LINES lines but those listed (with their line counts as ceilings: they shrink, never grow),
  module docstrings of at most MAX_DOCSTRING_LINES lines (what the module is for; the design is in docs/),
  the README and docs/architecture.md of at most MAX_DOC_LINES lines;
- one way into training: `python -m lmyard.stages train`;
- one way to a run's store: the run handle (`lmyard.run.Run.of(config)`), opened once and passed on.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from conftest import REPO

FOLDERS = ("lmyard", "flows", "tasks")


def _sources() -> list[tuple[str, ast.Module]]:
    return [
        (str(p.relative_to(REPO)), ast.parse(p.read_text()))
        for folder in FOLDERS
        for p in sorted((REPO / folder).rglob("*.py"))
    ]


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in name.split("."))


def _chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None where the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def names_used(tree: ast.Module, project: str) -> set[str]:
    """The dotted names of `project` a module imports or looks up (through the names it imported them as), each
    as far as the source spells it: `from torch.x import _y as z` then `z.w` is `torch.x._y.w`."""
    aliases: dict[str, str] = {}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == project:
                    aliases[a.asname or project] = a.name if a.asname else project
                    used.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == project:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                used.add(f"{node.module}.{a.name}")
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in aliases:
                used.add(".".join([aliases[chain[0]], *chain[1:]]))
    return used


def private_names(project: str) -> dict[str, set[str]]:
    """Private name of `project` -> the files that use it; only the longest spelling of each use (a module
    imported and then looked into is the name looked up)."""
    found: dict[str, set[str]] = {}
    for path, tree in _sources():
        for name in names_used(tree, project):
            if _private(name):
                found.setdefault(name, set()).add(path)
    return {n: files for n, files in found.items() if not any(o.startswith(n + ".") for o in found)}


def test_name_scan_follows_aliases_and_keeps_the_longest_spelling(tmp_path):
    tree = ast.parse(
        "import torch\n"
        "import torch.distributed._x as x\n"
        "from torch.a import _b as b, c\n"
        "def f():\n"
        "    from torch._inductor import config\n"
        "    config.flag = True\n"
        "    torch._foreach_add_(x.y.z, b.k)\n"
        "    return c.public\n"
    )
    used = names_used(tree, "torch")
    assert {
        "torch._foreach_add_",
        "torch.distributed._x.y.z",
        "torch.a._b.k",
        "torch._inductor.config.flag",
        "torch.a.c.public",
    } <= used


# ---------------------------------------------------------------- other projects' internals


def test_no_private_name_of_mlflow_or_prefect_is_used():
    found = {**private_names("mlflow"), **private_names("prefect")}
    assert not found, "use MLflow's and Prefect's public API: " + "; ".join(
        f"{n} in {', '.join(sorted(files))}" for n, files in sorted(found.items())
    )


def _assigned_attributes(tree: ast.Module) -> list[tuple[list[str], int]]:
    """Each `a.b = ...` (augmented and annotated included) and `setattr(a, "b", ...)`: (["a", "b"], line)."""
    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[0], ast.Name):
                out.append(([node.args[0].id, str(node.args[1].value)], node.lineno))
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and (chain := _chain(el)):
                    out.append((chain, node.lineno))
    return out


# torch elastic's PContext patched nowhere: a preempted rank, which must not make torchrun stop the others, exits 0
# under lmyard's torchrun, which then exits with its code (lmyard.launch.torchrun; test_preemption's
# test_a_rank_still_committing_30_s_after_another_ended_preempted_is_not_killed_and_the_node_exits_5 holds it)
PCONTEXT_PATCHES: set[str] = set()


def test_no_popen_swapped_and_no_pcontext_patched():
    popen, pcontext = [], set()
    for path, tree in _sources():
        for chain, line in _assigned_attributes(tree):
            if chain[-1] == "Popen" or chain[:2] == ["subprocess", "Popen"]:
                popen.append(f"{path}:{line}")
            if "PContext" in chain[:-1]:
                pcontext.add(path)
    assert not popen, f"subprocess.Popen reassigned (start the process yourself): {popen}"
    assert pcontext == PCONTEXT_PATCHES, f"PContext patched in {sorted(pcontext)}; use torchrun's public options"


def test_the_assignment_scan_sees_patches_in_every_spelling():
    tree = ast.parse(
        "import subprocess\n"
        "subprocess.Popen = Mine\n"
        "popen, subprocess.Popen = subprocess.Popen, Mine\n"
        "PContext.close = close\n"
        "setattr(PContext, 'close', close)\n"
    )
    chains = [chain for chain, _ in _assigned_attributes(tree)]
    assert chains == [["subprocess", "Popen"], ["subprocess", "Popen"], ["PContext", "close"], ["PContext", "close"]]


# torch's private names that lmyard uses, each for a reason of speed or memory (the module that uses it says
# which). A new one is added here; one no longer used is removed.
TORCH_PRIVATE = {
    "torch._C": "memory: the allocator's settings in this process (torch >= 2.11)",
    "torch._dynamo.utils.counters": "compile_cache: torch's FX graph and AOTAutograd cache hits (no public count)",
    "torch._foreach_add_": "optim: one launch for every parameter's step",
    "torch._foreach_mul_": "optim: one launch for the clipping scale",
    "torch._foreach_norm": "optim: one launch for the gradients' norms",
    "torch._inductor.config.emulate_precision_casts": "parallel: float8 rowwise as torchtitan compiles it",
    "torch._weights_only_unpickler": "checkpoint.readahead: loading from memory already read",
    "torch.autograd._unsafe_preserve_version_counter": "fsdp_copies: copies off the compute stream",
    "torch.cuda.memory._set_allocator_settings": "memory: the allocator's settings (torch < 2.11)",
    "torch.distributed._shard._utils.narrow_tensor_by_index": "checkpoint.dcp_load: reading shards in place",
    "torch.distributed._symmetric_memory.get_mem_pool": "parallel: copy-engine all-gathers",
    "torch.distributed._symmetric_memory.rendezvous": "parallel: copy-engine all-gathers",
    "torch.distributed._symmetric_memory.set_backend": "parallel: copy-engine all-gathers",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper": "parallel: activation ckpt",
    "torch.distributed.checkpoint._state_dict_stager.StateDictStager": "checkpoint.dcp: staging to pinned memory",
    "torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner": "checkpoint.dcp_load: loading to full",
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict": "checkpoint.dcp_load: one load, no collective",
    "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather": "parallel: copy-engine all-gathers",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives": "fsdp_copies (lmyard.train.distributed.fsdp_copies.missing)",
    "torch.distributed.fsdp._fully_shard._fsdp_param": "fsdp_copies (lmyard.train.distributed.fsdp_copies.missing)",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group": "fsdp_copies (lmyard.train.distributed.fsdp_copies.missing)",
    "torch.nn.attention._fa4.register_flash_attention_fa4": "flash4: FlashAttention-4 through torch's registry",
    "torch.ops._c10d_functional.reduce_scatter_tensor.default": "parallel: selective checkpointing's policy",
    "torch.serialization._load": "checkpoint.readahead: loading from memory already read",
    "torch.serialization._open_zipfile_reader": "checkpoint.readahead: loading from memory already read",
    "torch.utils._pytree.tree_map_only": "checkpoint.dcp",
}
# looked up only where torch has them: the code checks for them and takes another path otherwise
TORCH_OPTIONAL = {"torch.nn.attention._fa4.register_flash_attention_fa4", "torch.cuda.memory._set_allocator_settings"}


def test_the_private_names_of_torch_in_use_are_the_listed_ones():
    found = private_names("torch")
    new = {n: sorted(f) for n, f in found.items() if n not in TORCH_PRIVATE}
    assert not new, f"torch's private names not listed in TORCH_PRIVATE (list each, with why): {new}"
    gone = sorted(set(TORCH_PRIVATE) - set(found))
    assert not gone, f"listed in TORCH_PRIVATE but no longer used (remove them): {gone}"


def lookup(name: str) -> object:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj: object = importlib.import_module(module)
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


@pytest.mark.parametrize("name", sorted(set(TORCH_PRIVATE) - TORCH_OPTIONAL))
def test_each_private_name_of_torch_in_use_is_where_lmyard_looks_it_up(name):
    try:
        lookup(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"torch moved {name} ({e}); {TORCH_PRIVATE[name]}")


def test_the_fsdp2_internals_that_side_copies_rebind_are_all_there():
    from lmyard.train.distributed.fsdp_copies import missing

    assert missing() is None


# ---------------------------------------------------------------- sizes

MAX_FUNCTION_LINES = 50
MAX_PARAMETERS = 10  # self and cls not counted; keyword-only counted
MAX_MODULE_LINES = 500
# modules over MAX_MODULE_LINES and their line counts: a ceiling each; split one and remove it from here
LONG_MODULES: dict[str, int] = {}
# functions over MAX_FUNCTION_LINES or MAX_PARAMETERS ("path:qualified name": its lines, its parameters): a
# ceiling each, they shrink, never grow; split one (or group its parameters) and remove it from here. The two
# Triton kernels take one parameter per pointer, stride and block size, as Triton's kernels do.
OVER_BOUND: dict[str, tuple[int, int]] = {
    "lmyard/models/ops/rope.py:_rope_kernel": (41, 12),
    "lmyard/train/optim.py:_adamw_kernel": (0, 11),
}


def _qualified(node: ast.AST, prefix: str = ""):
    """("Class.method", node) of every function under `node`, nested ones as "outer.inner"."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _qualified(child, f"{name}.")
        else:
            yield from _qualified(child, prefix)


def _functions():
    """(path, "qualified name", node) of every function of lmyard/, flows/ and tasks/."""
    for path, tree in _sources():
        for name, node in _qualified(tree):
            yield path, name, node


def _lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From `def` to the function's last line (decorators not counted, its docstring counted)."""
    return (fn.end_lineno or fn.lineno) - fn.lineno + 1


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    return len(positional) + len(a.kwonlyargs) - (1 if positional[:1] in (["self"], ["cls"]) else 0)


def _bound(path: str, name: str) -> tuple[int, int]:
    lines, parameters = OVER_BOUND.get(f"{path}:{name}", (0, 0))
    return max(lines, MAX_FUNCTION_LINES), max(parameters, MAX_PARAMETERS)


def test_no_function_is_over_the_line_bound():
    long = [
        f"{path}:{fn.lineno} {name} ({_lines(fn)} lines)"
        for path, name, fn in _functions()
        if _lines(fn) > _bound(path, name)[0]
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines or OVER_BOUND's ceiling (split them): {long}"


def test_no_function_takes_more_than_the_parameter_bound():
    many = [
        f"{path}:{fn.lineno} {name} ({_parameters(fn)})"
        for path, name, fn in _functions()
        if _parameters(fn) > _bound(path, name)[1]
    ]
    assert not many, (
        f"functions with more than {MAX_PARAMETERS} parameters or OVER_BOUND's ceiling (group them in a "
        f"dataclass): {many}"
    )


def test_the_functions_over_the_bounds_are_still_there_and_still_over():
    found = {f"{path}:{name}": (_lines(fn), _parameters(fn)) for path, name, fn in _functions()}
    stale = [
        key
        for key in OVER_BOUND
        if key not in found or (found[key][0] <= MAX_FUNCTION_LINES and found[key][1] <= MAX_PARAMETERS)
    ]
    assert not stale, f"within the bounds now, or gone: remove them from OVER_BOUND: {stale}"


MAX_DOCSTRING_LINES = 12  # quotes included: what the module is for and its API; the design notes live in docs/


def _docstring_lines(tree: ast.Module) -> int:
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def test_no_module_docstring_is_over_the_bound():
    long = [f"{path} ({n} lines)" for path, tree in _sources() if (n := _docstring_lines(tree)) > MAX_DOCSTRING_LINES]
    assert not long, (
        f"module docstrings over {MAX_DOCSTRING_LINES} lines (keep what the module is for and its API; move the "
        f"design to its page in docs/): {long}"
    )


def test_the_docstring_count_spans_the_quotes_and_ignores_a_first_string_that_is_no_docstring():
    assert _docstring_lines(ast.parse('"""One.\n\nTwo.\n"""\nx = 1\n')) == 4
    assert _docstring_lines(ast.parse('x = 1\n"""not a docstring"""\n')) == 0
    assert _docstring_lines(ast.parse("")) == 0


# the README is a door and docs/architecture.md a map: the detail lives in the topic pages of docs/
MAX_DOC_LINES = {"README.md": 250, "docs/architecture.md": 350}


def test_the_readme_and_the_architecture_page_stay_within_their_line_bounds():
    lines = {doc: len((REPO / doc).read_text().splitlines()) for doc in MAX_DOC_LINES}
    over = {doc: n for doc, n in lines.items() if n > MAX_DOC_LINES[doc]}
    assert not over, f"over their bounds {MAX_DOC_LINES} (move the detail to a topic page of docs/): {over}"


def test_no_module_grows_past_its_line_bound():
    lines = {path: len((REPO / path).read_text().splitlines()) for path, _ in _sources()}
    over = {p: n for p, n in lines.items() if n > LONG_MODULES.get(p, MAX_MODULE_LINES)}
    assert not over, f"modules over their bound ({MAX_MODULE_LINES} lines, or LONG_MODULES' ceiling): {over}"
    shrunk = sorted(p for p in LONG_MODULES if lines.get(p, 0) <= MAX_MODULE_LINES)
    assert not shrunk, f"within {MAX_MODULE_LINES} lines now: remove them from LONG_MODULES: {shrunk}"


# ---------------------------------------------------------------- the trainer is the loop

TRAINER = REPO / "lmyard" / "train" / "trainer.py"
TRAINER_MAX_LINES, TRAINER_MAX_LMYARD_MODULES = 400, 15


def lmyard_modules_imported(path: Path) -> set[str]:
    """The lmyard modules `path` imports, at module level or inside functions: `from lmyard.a import b` is
    `lmyard.a.b` where b is a module of its own, else `lmyard.a`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lmyard"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "lmyard":
            base = node.module or ""
            folder = REPO.joinpath(*base.split("."))
            subs = {f"{base}.{a.name}" for a in node.names if (folder / f"{a.name}.py").is_file()}
            subs |= {f"{base}.{a.name}" for a in node.names if (folder / a.name / "__init__.py").is_file()}
            found |= subs or {base}
    return found


def _branches_on_parallel(tree: ast.AST) -> list[int]:
    """Lines of each `if` (statement or expression) whose test reads `train.parallel` (also as `t.parallel`, t
    the train section) or names "fsdp"; asking the strategy (`self.parallel.sharded`) is not reading it."""

    def train_section(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "train") or (isinstance(n, ast.Name) and n.id == "t")

    def names_it(test: ast.AST) -> bool:
        return any(
            (isinstance(n, ast.Attribute) and n.attr == "parallel" and train_section(n.value))
            or (isinstance(n, ast.Constant) and n.value == "fsdp")
            for n in ast.walk(test)
        )

    return sorted(n.lineno for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp)) and names_it(n.test))


def test_the_trainer_is_the_loop_with_one_door_to_checkpoints_and_no_branch_on_the_strategy():
    lines = len(TRAINER.read_text().splitlines())
    assert lines <= TRAINER_MAX_LINES, f"lmyard/train/trainer.py has {lines} lines, over {TRAINER_MAX_LINES}"
    modules = lmyard_modules_imported(TRAINER)
    assert len(modules) <= TRAINER_MAX_LMYARD_MODULES, f"the trainer imports {len(modules)}: {sorted(modules)}"
    checkpoint = sorted(m for m in modules if m.startswith("lmyard.checkpoint"))
    assert checkpoint == ["lmyard.checkpoint.manager"], f"the trainer's checkpoint imports: {checkpoint}"
    branches = _branches_on_parallel(ast.parse(TRAINER.read_text()))
    assert not branches, f"lmyard/train/trainer.py branches on train.parallel or fsdp at lines {branches}"


def test_the_trainer_checks_see_submodules_and_branches_on_the_strategy(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from lmyard.train import build, components\n"
        "from lmyard.errors import UserError\n"
        "def f(cfg):\n"
        "    import lmyard.checkpoint.resume\n"
        "    x = 1 if cfg.train.parallel == 'ddp' else 2\n"
        "    if cfg.train.kind == 'fsdp':\n"
        "        pass\n"
        "    if self.parallel.sharded or t.parallel:\n"
        "        pass\n"
    )
    assert lmyard_modules_imported(sample) == {
        "lmyard.train.build",
        "lmyard.train.components",
        "lmyard.errors",
        "lmyard.checkpoint.resume",
    }
    assert _branches_on_parallel(ast.parse(sample.read_text())) == [5, 6, 8]


def test_the_size_checks_count_lines_and_parameters_as_they_say():
    [cls] = ast.parse(
        "class A:\n    @staticmethod\n    def f(self, a, /, b, *args, c, d=1, **kw):\n        pass\n"
    ).body
    [fn] = cls.body
    assert _parameters(fn) == 4 and _lines(fn) == 2
    tree = ast.parse(
        "class A:\n    def f(self):\n        def g():\n            pass\nif x:\n    def h():\n        pass\n"
    )
    assert [name for name, _ in _qualified(tree)] == ["A.f", "A.f.g", "h"]


# ---------------------------------------------------------------- one way into training


TRAIN_MODULE_RUN = re.compile(r"""-m["',\s]*lmyard\.train(?![\w.])""")  # `-m lmyard.train`, also as list items


def _tracked_files() -> list[Path]:
    """The repository's files as git knows them (tracked or new, not ignored: no .venv, no caches)."""
    import subprocess

    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [REPO / line for line in out.splitlines() if (REPO / line).is_file()]


def test_training_has_one_entry_the_train_stage():
    assert importlib.util.find_spec("lmyard.train.__main__") is None, "python -m lmyard.train is back"
    import lmyard.train.trainer as trainer

    assert not hasattr(trainer, "main"), "lmyard.train.trainer.main is a second entry: use lmyard.stages"
    users = [
        str(p.relative_to(REPO))
        for p in _tracked_files()
        if p != Path(__file__)
        and (p.suffix in {".py", ".md", ".yaml", ".toml", ".sh"} or p.name == "Dockerfile")
        and TRAIN_MODULE_RUN.search(p.read_text(errors="replace"))
    ]
    assert not users, f"these start training as `-m lmyard.train`: use `-m lmyard.stages train`: {users}"


# ---------------------------------------------------------------- markers


def test_the_private_ray_name_that_folds_the_clusters_dumps_is_where_lmyard_looks_it_up():
    """lmyard.launch.ray wraps Ray's driver printer (no public hook exists for what the cluster publishes): a Ray
    release that moves it must fail here, not silently print the raylet's dumps again."""
    pytest.importorskip("ray")
    import inspect

    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    assert callable(printer), "Ray moved ray._private.worker.print_to_stdstream; see lmyard.launch.ray"
    assert list(inspect.signature(printer).parameters)[:2] == ["data", "ignore_prefix"]


# ---------------------------------------------------------------- one run handle

MAX_OPEN_STORE = 10  # Run.of, the store's own definition and doc, and the stores that are no run's (exports, data)


def open_store_lines() -> list[str]:
    """`path:line` of each line of lmyard/, flows/ and tasks/ that calls (or shows) `open_store(`."""
    return [
        f"{p.relative_to(REPO)}:{i}"
        for folder in FOLDERS
        for p in sorted((REPO / folder).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "open_store(" in line
    ]


def test_a_runs_store_is_opened_through_the_run_handle_only():
    sites = open_store_lines()
    assert len(sites) <= MAX_OPEN_STORE, (
        f"open_store( appears {len(sites)} times, over {MAX_OPEN_STORE}: open the run's store once with "
        "lmyard.run.Run.of(config) and pass the handle on:\n" + "\n".join(sites)
    )
    config_store = re.compile(r"open_store\(\w+\.store\)")
    reopened = [
        f"{p.relative_to(REPO)}:{i}"
        for folder in FOLDERS
        for p in sorted((REPO / folder).rglob("*.py"))
        if p != REPO / "lmyard" / "run.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if config_store.search(line)
    ]
    assert not reopened, "a config's store opened beside lmyard.run.Run.of: " + ", ".join(reopened)


# ---------------------------------------------------------------- one MLflow client


def test_an_mlflow_client_is_made_in_one_place_only():
    sites = [
        f"{p.relative_to(REPO)}:{i}"
        for folder in FOLDERS
        for p in sorted((REPO / folder).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "MlflowClient(" in line
    ]
    assert len(sites) == 1 and sites[0].startswith("lmyard/tracking/client.py:"), (
        "make MLflow clients with lmyard.tracking.client.mlflow_client: " + ", ".join(sites)
    )
