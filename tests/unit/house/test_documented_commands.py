"""The shell and Python blocks of the README and docs/*.md: the Python blocks run as written, the shell blocks'
commands are each run, skipped or marked (tests/integration/test_documented_commands_integration.py runs them).

Every fence names its language, and every shell or Python block is run unless the line before its fence is
`<!-- not run: WHY -->` (tests/docblocks.py reads the blocks and checks the markers). A Python block runs as a
script in a folder of its own. Every entry of SKIP (tests/documented_commands_helpers.py) matches a command.
Skipped or marked `lmyard run|shard` lines still have their recipe and `--set`s checked by `lmyard config`, and
every `python -m MODULE` and `*.py` script any fenced block names must exist.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys

from conftest import REPO
from docblocks import DOCS, PYTHON, SHELL, blocks, problems, run_python
from documented_commands_helpers import SKIP, _expected_deployments, bash_blocks


def test_every_fence_names_its_language_and_every_marker_says_why():
    found = [p for doc in DOCS for p in problems(doc)]
    assert not found, "\n".join(found)


def test_every_documented_command_runs_in_the_test_or_is_skipped_for_a_stated_reason():
    commands = [c for block in bash_blocks() for c in block]
    assert any(c.text.startswith("prefect deploy ") for c in commands)
    for pattern, _ in SKIP:
        assert any(re.match(pattern, c.text) for c in commands), f"SKIP entry {pattern!r} matches no command"


def test_documented_modules_and_scripts_exist():
    """`python -m X` and `path/x.py` in any command-like line of a fenced block name what the tree holds."""
    starts = re.compile(r"^(\S+=\S+ )*(\S*/)?(python3?|torchrun|lmyard) ")  # commands among ```text listings
    missing = []
    for doc in DOCS:
        shell = [c for b in blocks(doc) if b.lang in SHELL for c in b.commands()]
        listed = [c for b in blocks(doc) if b.lang not in SHELL + PYTHON for c in b.commands() if starts.match(c.text)]
        for c in shell + listed:
            text = c.text.split(" # ")[0]
            for module in re.findall(r"\bpython3?\s+-m\s+([\w.]+)", text):
                if module not in ("venv", "pip") and importlib.util.find_spec(module) is None:
                    missing.append(f"{c.doc}:{c.line}: module {module}")
            for script in re.findall(r"(?<![\w/.])((?:tests|lmyard|flows|tasks)/[\w/]+\.py)\b", text):
                if not (REPO / script).is_file():
                    missing.append(f"{c.doc}:{c.line}: script {script}")
    assert not missing, "documented commands name what does not exist:\n" + "\n".join(missing)


def test_documented_training_commands_have_a_valid_recipe_and_overrides():
    """A `lmyard run|shard RECIPE --set ...` of the docs (marked blocks too) resolves: `lmyard config` accepts the
    same arguments."""
    checked = 0
    for block in bash_blocks(marked=True):
        for c in block:
            words = shlex.split(c.text.split(" # ")[0])
            if words[:2] in (["lmyard", "run"], ["lmyard", "shard"]):
                args = [sys.executable, "-m", "flows.cli", "config", *words[2:]]
                done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, f"{c.doc}:{c.line}: {c.text}\n{done.stderr[-2000:]}"
                checked += 1
    assert checked >= 2


def test_documented_python_blocks_run_as_scripts(tmp_path):
    """Each unmarked Python block, as a script in a folder of its own with this checkout on PYTHONPATH, exits 0."""
    python = [b for doc in DOCS for b in blocks(doc) if b.lang in PYTHON]
    assert python
    for b in python:
        if b.not_run is None:
            folder = tmp_path / f"{b.doc}-{b.line}"
            folder.mkdir()
            done = run_python(b, folder)
            assert done.returncode == 0, f"{b.doc}:{b.line}:\n" + "\n".join(b.body) + f"\n{done.stderr[-3000:]}"


SAMPLE = """# A page

<!-- not run: needs a GPU -->
```python
raise SystemExit("not run")
```

```python
import lmyard
print(lmyard.__name__)
```

  <!-- not run: blocks -->
  ```console
  $ prefect worker start \\
      --pool p
  Worker started!
  ```

```
plain
```

<!-- not run: -->
```bash
true
```

<!-- not run -->
```py
raise SystemExit(3)
```

<!-- not run: a listing -->
```text
out
```

<!-- not run: nothing below -->
"""


def test_the_block_checks_see_languages_markers_and_a_block_that_fails(tmp_path):
    """The rules the docs are held to, on a sample page: a fence without a language, a marker without a reason, a
    marker on a block never run, a marker on no fence; a Python block that fails is seen failing."""
    page = tmp_path / "page.md"
    page.write_text(SAMPLE)
    found = blocks(page)
    assert [(b.line, b.lang, b.not_run) for b in found] == [
        (4, "python", "needs a GPU"),
        (8, "python", None),
        (14, "console", "blocks"),
        (20, "", None),
        (25, "bash", None),
        (30, "py", None),
        (35, "text", "a listing"),
    ]
    assert [c.text for c in found[2].commands()] == ["prefect worker start --pool p"]
    assert [p.split(": ", 1) for p in problems(page)] == [
        ["page.md:20", "a fence without a language (```bash, ```python, ```text, ...)"],
        ["page.md:25", "a marker without a reason (<!-- not run: -->): `<!-- not run: WHY -->`"],
        ["page.md:30", "a marker without a reason (<!-- not run -->): `<!-- not run: WHY -->`"],
        ["page.md:35", "a `not run` marker on a ```text block, which is never run"],
        ["page.md:39", "a `not run` marker that is not on the line just before a fence"],
    ]
    ran = run_python(found[1], tmp_path)
    assert ran.returncode == 0 and ran.stdout == "lmyard\n", ran.stderr
    assert run_python(found[5], tmp_path).returncode == 3  # what the test sees of an unmarked block that fails


def test_operations_counts_and_names_the_deployments_and_the_clone_warnings_as_prefect_yaml_has_them():
    import yaml

    deployments = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())["deployments"]
    cloning = [d for d in deployments if "git_clone" in str(d.get("pull"))]
    text = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert f"holds the {len(deployments)} deployments" in text
    assert f"prints {len(cloning)} warnings `Value for placeholder 'clone.directory' not found`" in text
    missing = [name for name in _expected_deployments() if f"`{name}`" not in text]
    assert not missing, f"docs/operations.md does not list {missing}"
