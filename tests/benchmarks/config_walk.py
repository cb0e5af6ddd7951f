"""The walk of the pretrain flow's config: which of lmyard's functions the run's config passes through.

    python tests/benchmarks/config_walk.py                              # this checkout
    python tests/benchmarks/config_walk.py --tree /path/to/other/checkout  # another tree
    python tests/benchmarks/config_walk.py --tree OLD --tree NEW        # both, side by side

It runs the pretrain flow in this process (`lmyard run smoke` through flows.cli.main, on Prefect's temporary
server) on a tiny smoke run in a temporary folder (the cwd, the store, MLflow's sqlite, LMYARD_CACHE,
PREFECT_HOME): a 1-layer model, `--steps` steps (2: one checkpoint the flow picks up while training, the final
one), one trainer rank, no system metrics. Every stage of the flow runs.

A profile hook (sys.setprofile, and threading.setprofile for Prefect's worker threads) records each call of a
function defined in the tree's lmyard/, flows/ or tasks/ that gets a config as an argument (positional, keyword,
`self`, or inside *args/**kwargs): a RunConfig or one of its sections, i.e. an instance of any pydantic model
class defined in the tree's config module or package (found by walking it, so trees of either layout work).
A generator counts once, when it starts. The trainer ranks are subprocesses: only the orchestrating process
is measured.

Per thread, the modules of those calls in order are the walk. It prints:
  stops        the calls
  rooms        the distinct modules of the calls
  climbs back  the times a walk enters a module it had visited before and left (A B A counts 1)
  store        the times the walk enters the store module (lmyard/store), and its stops there; and apart from
               the walk, how many times lmyard.store.open_store is called (a config's store opened), whatever
               its arguments
and the first three again with the config module(s) left out of the walk: their own methods and validators,
which a config calls on itself, are one module in one tree and several in another; without them the figures
say how the rest of the code hands the config around. Then the stops and entries of each module (the 15 with
most stops), the walk of each thread, the functions with most stops, and a `summary {...}` JSON line. With
several --tree, each runs in a process of its own and the figures are printed side by side.
"""

from __future__ import annotations

import argparse
import atexit
import dis
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("lmyard", "flows", "tasks")
STORE = "lmyard.store"
TOP = 15
# generator, coroutine, async generator: their frame "calls" again at each resume
RESUMABLE = 0x20 | 0x80 | 0x200


def overrides(tmp: Path, steps: int) -> list[str]:
    """A tiny smoke run under tmp: the flow's stages all run, with as little else as the config allows."""
    values = {
        "store": str(tmp / "store"),
        "tracking.uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "tracking.system_metrics": "false",
        "data.max_documents": 200,
        "train.max_steps": steps,
        "train.warmup_steps": 1,
        "train.batch_tokens": 256,
        "train.micro_batch": 4,
        "train.log_interval": 1,
        "train.device": "cpu",
        "train.compile": "false",
        "train.threads_per_rank": 1,
        "model.n_layer": 1,
        "model.n_embd": 32,
        "model.n_head": 2,
        "model.block_size": 64,
        "eval.interval": steps,
        "eval.val_tokens": 1024,
        "eval.sample_tokens": 8,
        "eval.prompts": "[A class is]",
        "eval.threads": 1,
        "eval.poll_s": 0.5,
        "checkpoint.interval": max(1, steps // 2),
        "launch.nproc_per_node": 1,
    }
    return [f"{k}={v}" for k, v in values.items()]


def config_classes() -> tuple[type, ...]:
    """The pydantic models defined in the tree's lmyard.config, a module or a package (its modules walked)."""
    from pydantic import BaseModel

    root = importlib.import_module("lmyard.config")
    modules = [root]
    if hasattr(root, "__path__"):
        for info in pkgutil.walk_packages(root.__path__, prefix="lmyard.config."):
            modules.append(importlib.import_module(info.name))
    found = {}
    for module in modules:
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, BaseModel)
                and (obj.__module__ == "lmyard.config" or obj.__module__.startswith("lmyard.config."))
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return tuple(found[k] for k in sorted(found))


class Walks:
    """The profile hook: per thread, (module, function) of each call of the tree's code that gets a config."""

    def __init__(self, tree: Path, classes: tuple[type, ...]):
        self.prefixes = tuple(f"{tree / p}{os.sep}" for p in PACKAGES)
        self.tree = tree
        self.classes = classes
        self.code: dict = {}  # code object -> (module, qualname, first resume offset) or None: outside the tree
        self.threads: dict[int, tuple[str, list[tuple[str, str]]]] = {}
        self.store_opens = 0  # calls of lmyard.store.open_store, whatever their arguments

    def _place(self, code):
        name = code.co_filename
        if not name.startswith(self.prefixes):
            return None
        parts = list(Path(name).relative_to(self.tree).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        start = -1
        if code.co_flags & RESUMABLE:  # the first RESUME is where the generator starts; later ones are resumes
            start = next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
        module = ".".join(parts)
        return module, code.co_qualname, start, module == STORE and code.co_qualname == "open_store"

    def _carries_config(self, frame, code) -> bool:
        n = code.co_argcount + code.co_kwonlyargcount
        star, stars = code.co_flags & 0x04, code.co_flags & 0x08  # CO_VARARGS, CO_VARKEYWORDS
        values = frame.f_locals
        names = code.co_varnames
        classes = self.classes
        for name in names[:n]:
            if isinstance(values.get(name), classes):
                return True
        if star:
            if any(isinstance(v, classes) for v in values.get(names[n], ())):
                return True
            n += 1
        if stars:
            kwargs = values.get(names[n]) or {}
            if any(isinstance(v, classes) for v in kwargs.values()):
                return True
        return False

    def hook(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        try:
            place = self.code[code]
        except KeyError:
            place = self.code[code] = self._place(code)
        if place is None:
            return
        module, function, start, opens = place
        self.store_opens += opens
        if start >= 0 and frame.f_lasti > start:
            return
        if not self._carries_config(frame, code):
            return
        ident = threading.get_ident()
        walk = self.threads.get(ident)
        if walk is None:
            walk = self.threads[ident] = (threading.current_thread().name, [])
        walk[1].append((module, function))

    def start(self) -> None:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def entries(modules: list[str]) -> list[str]:
    """The walk with consecutive stops in one module as one entry."""
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def climbs_back(modules: list[str]) -> int:
    seen: set[str] = set()
    n = 0
    for m in entries(modules):
        n += m in seen
        seen.add(m)
    return n


def is_config(module: str) -> bool:
    return module == "lmyard.config" or module.startswith("lmyard.config.")


def figures(walks: Walks) -> dict:
    outside = [[m for m, _ in calls if not is_config(m)] for _, calls in walks.threads.values()]
    stops: Counter[str] = Counter()
    entered: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    threads = []
    for name, calls in walks.threads.values():
        modules = [m for m, _ in calls]
        stops.update(modules)
        entered.update(entries(modules))
        functions.update(f"{m}.{f}" for m, f in calls)
        threads.append(
            {
                "thread": name,
                "stops": len(modules),
                "rooms": len(set(modules)),
                "climbs_back": climbs_back(modules),
                "walk": entries(modules),
            }
        )
    in_store = [m for m in stops if m == STORE or m.startswith(STORE + ".")]
    return {
        "stops": sum(stops.values()),
        "rooms": len(stops),
        "climbs_back": sum(t["climbs_back"] for t in threads),
        "stops_outside_config": sum(len(w) for w in outside),
        "rooms_outside_config": len({m for w in outside for m in w}),
        "climbs_back_outside_config": sum(climbs_back(w) for w in outside),
        "store_entries": sum(entered[m] for m in in_store),
        "store_stops": sum(stops[m] for m in in_store),
        "store_opens": walks.store_opens,
        "threads": threads,
        "modules": {m: {"stops": s, "entries": entered[m]} for m, s in stops.most_common()},
        "functions": dict(functions.most_common(TOP)),
    }


def commit_of(tree: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def measure(tree: Path, steps: int, keep: bool) -> dict:
    """Run the flow of `tree` here, under the profile hook; its figures."""
    sys.path.insert(0, str(tree))
    # the trainer ranks (`python -m lmyard.dispatch ...`, cwd the temporary folder) import the same tree
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    tmp = Path(tempfile.mkdtemp(prefix="config-walk-"))
    if not keep:  # registered first, so it runs last: after Prefect's own hook stops its temporary server
        atexit.register(shutil.rmtree, tmp, True)
    os.environ["LMYARD_CACHE"] = str(tmp / "cache")
    os.environ["PREFECT_HOME"] = str(tmp / "prefect-home")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.chdir(tmp)

    import lmyard

    if not Path(lmyard.__file__).resolve().is_relative_to(tree):
        sys.exit(f"config_walk: lmyard imports from {lmyard.__file__}, not from {tree}")
    classes = config_classes()
    walks = Walks(tree, classes)
    walks.start()  # before Prefect is imported: its threads start after this
    t0 = time.monotonic()
    try:
        from flows.cli import main

        code = main(["run", "smoke", *[a for o in overrides(tmp, steps) for a in ("--set", o)]])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        walks.stop()
    os.chdir(tree)
    result = {
        "tree": str(tree),
        "commit": commit_of(tree),
        "exit_code": code,
        "wall_s": round(time.monotonic() - t0, 1),
        "config_classes": [c.__qualname__ for c in classes],
        **figures(walks),
    }
    if keep:
        result["folder"] = str(tmp)
    return result


def table(results: list[dict]) -> str:
    """Markdown: the figures, the modules with most stops, each tree a column (stops / entries)."""
    heads = [f"{Path(r['tree']).name} ({r['commit'] or '?'})" for r in results]
    rows = [
        "| | " + " | ".join(heads) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for key, label in (
        ("stops", "stops"),
        ("rooms", "rooms"),
        ("climbs_back", "climbs back"),
        ("stops_outside_config", "stops outside the config module(s)"),
        ("rooms_outside_config", "rooms outside the config module(s)"),
        ("climbs_back_outside_config", "climbs back, config module(s) left out of the walk"),
        ("store_entries", "store.py entered with config"),
        ("store_stops", "store.py stops"),
        ("store_opens", "open_store calls (any argument)"),
    ):
        rows.append(f"| {label} | " + " | ".join(str(r[key]) for r in results) + " |")
    rows.append("| threads with a walk | " + " | ".join(str(len(r["threads"])) for r in results) + " |")
    rows.append("| flow exit code | " + " | ".join(str(r["exit_code"]) for r in results) + " |")
    rows.append("")
    modules: list[str] = []
    for r in results:
        for m in list(r["modules"])[:TOP]:
            if m not in modules:
                modules.append(m)
    modules.sort(key=lambda m: -max(r["modules"].get(m, {}).get("stops", 0) for r in results))
    rows.append("| module (stops / entries) | " + " | ".join(heads) + " |")
    rows.append("|---|" + "---:|" * len(results))
    for m in modules:
        cells = []
        for r in results:
            got = r["modules"].get(m)
            cells.append(f"{got['stops']} / {got['entries']}" if got else "-")
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def details(r: dict) -> str:
    lines = [f"{r['tree']}: the walk of each thread (modules entered, in order)"]
    for t in r["threads"]:
        lines.append(f"  {t['thread']}: {t['stops']} stops, {t['rooms']} rooms, {t['climbs_back']} climbs back")
        lines.append("    " + " > ".join(t["walk"]))
    lines.append(f"{r['tree']}: the functions with most stops")
    lines += [f"  {n:4d}  {f}" for f, n in r["functions"].items()]
    return "\n".join(lines)


def summary(r: dict) -> dict:
    keep = (
        "tree",
        "commit",
        "exit_code",
        "wall_s",
        "stops",
        "rooms",
        "climbs_back",
        "stops_outside_config",
        "rooms_outside_config",
        "climbs_back_outside_config",
        "store_entries",
        "store_stops",
        "store_opens",
    )
    return {
        **{k: r[k] for k in keep},
        "modules": {m: v["stops"] for m, v in list(r["modules"].items())[:TOP]},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=Path, help="the checkout measured (repeatable; default: this one)")
    p.add_argument("--steps", type=int, default=2, help="train.max_steps (default 2)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    p.add_argument("--json", type=Path, help="also write every figure, each thread's walk included, to this file")
    args = p.parse_args()
    trees = [t.resolve() for t in args.tree or [REPO]]
    if len(trees) == 1:
        results = [measure(trees[0], args.steps, args.keep)]
    else:  # each tree in a process of its own: a process imports one lmyard
        results = []
        for tree in trees:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--tree", str(tree), "--steps", str(args.steps), "--json", f.name]
                subprocess.run(cmd + (["--keep"] if args.keep else []), check=False)
                results.append(json.loads(Path(f.name).read_text() or "null"))
        results = [r for r in results if r]
    print()
    if len(trees) == 1:  # with several, each tree's process printed its own
        print(details(results[0]))
        print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
    for r in results:
        print("summary " + json.dumps(summary(r)))
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
