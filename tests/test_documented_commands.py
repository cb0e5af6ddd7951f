"""The shell and Python blocks of the README and docs/*.md, run as written (the shell's against a real Prefect server).

Every fence names its language, and every shell or Python block is run here unless the line before its fence is
`<!-- not run: WHY -->` (tests/docblocks.py reads the blocks and checks the markers). A Python block runs as a
script in a folder of its own. A shell block's lines run as one bash script (so `IMAGE=$(...)` carries to the next
line), less the lines SKIP matches with a reason; a command neither run, skipped nor marked fails the test.
Skipped or marked `lmyard run|shard` lines still have their recipe and `--set`s checked by `lmyard config`, and
every `python -m MODULE` and `*.py` script any fenced block names must exist.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, prefect_server
from docblocks import DOCS, PYTHON, SHELL, Block, Command, blocks, problems, run_python

# (regex matched at the start of a command, why the test does not run it). Every entry must match
# some documented command, so that the list cannot go stale.
SKIP: list[tuple[str, str]] = [
    (r"python3 -m venv ", "creates a virtualenv and installs packages; the tests run in an installed one"),
    (r"apt-get install ", "changes the machine's packages"),
    (r"pip install ", "changes the virtualenv's packages (an extra's tests skip, saying so, when it is missing)"),
    (r"\.venv/bin/ruff check ", "the checks CI runs (.ci/run), in the virtualenv the line before creates"),
    (r"\.venv/bin/python -m pytest", "the test suite itself (the unit tier, then the integration tier; CI runs it)"),
    (r"prefect worker start ", "blocks: a worker serves until stopped (tests/test_deployments.py starts one)"),
    (r"ray start ", "starts a Ray node on a host (tests/test_hosts_ray.py starts them in simulated hosts)"),
    (
        r"cd \S+ && PREFECT_API_URL=\S+ prefect worker start ",
        "blocks: a worker on another host (tests/test_hosts_prefect.py)",
    ),
    (r"prefect deployment run ", "starts a training run (tests/test_deployments.py runs the deployments)"),
    (r"(\.venv/bin/)?mlflow (ui|server) ", "blocks: a server runs until stopped"),
    (r"lmyard run gpt2-124m --set run_name=gpt2-quickstart ", "needs a GPU"),
    (r"lmyard (run|shard) ", "a training run; its recipe and --set overrides are checked with `lmyard config`"),
    (r"lmyard (eval|sample) ", "needs a trained checkpoint (tests/test_ops.py evaluates and samples one)"),
    (r"python -m flows\.notifications ", "needs a webhook (tests/test_promotion.py runs one on 127.0.0.1)"),
    (r"lmyard sweep ", "trains a lineage per trial, minutes (tests/test_sweeps.py runs sweeps of sizes and a search)"),
    (r"lmyard export ", "needs a trained checkpoint (tests/test_export.py exports one)"),
    (r"python -m lmyard\.launch\.images build", "builds the stage image for minutes (tests/test_docker.py)"),
    (r"python -m lmyard\.launch\.images prune", "removes Docker images of this machine"),
    (r"docker run ", "runs the stage image (tests/test_docker.py builds it and runs the stages in it)"),
    (r"docker pull ", "needs an image registry; none is reachable here"),
    (
        r"kubectl ",
        "needs a Kubernetes cluster; none is here (tests/test_kubernetes.py validates the manifests offline)",
    ),
    (
        r"tar -C / -c ",
        "imports this machine's own root filesystem into Docker (GBs, an untagged copy left at each rerun): a GPU "
        "host's set-up, which tests/benchmarks/docker_on_gpu_host.sh runs there",
    ),
    (r"TIKTOKEN_CACHE_DIR=\S+ \S*python tests/benchmarks/", "a benchmark: long, prints figures"),
]


def skip_reason(command: Command) -> str | None:
    return next((why for pattern, why in SKIP if re.match(pattern, command.text)), None)


def shell_blocks(marked: bool = False) -> list[Block]:
    """The shell blocks of the docs: those run (with `marked`, the marked ones too)."""
    return [b for doc in DOCS for b in blocks(doc) if b.lang in SHELL and (marked or b.not_run is None)]


def bash_blocks(marked: bool = False) -> list[list[Command]]:
    return [cs for b in shell_blocks(marked) if (cs := b.commands())]


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


def _reset(api_url: str) -> None:
    """Remove what a block deployed, so the next block meets an empty server as an operator's first run does."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        for d in client.read_deployments():
            client.delete_deployment(d.id)
        for a in client.read_automations():
            client.delete_automation(a.id)
        for pool in client.read_work_pools():
            client.delete_work_pool(pool.name)


def _deployed(api_url: str) -> tuple[dict[str, dict], list]:
    """{'flow/deployment': {id, work_pool, image}} and the automations on the server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        deployments = {
            f"{flows[d.flow_id]}/{d.name}": {
                "id": d.id,
                "work_pool": d.work_pool_name,
                "image": (d.job_variables or {}).get("image"),
            }
            for d in client.read_deployments()
        }
        return deployments, client.read_automations()


def _expected_deployments() -> dict[str, str]:
    """{'flow/deployment': work pool} of deploy/prefect.yaml (the flow's name is its entrypoint's flow's)."""
    import importlib

    import yaml

    spec = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    expected = {}
    for d in spec["deployments"]:
        path, function = d["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), function)
        expected[f"{flow.name}/{d['name']}"] = d["work_pool"]["name"]
    return expected


def _assert_everything_deployed(api_url: str, where: str) -> None:
    deployments, automations = _deployed(api_url)
    for name, pool in _expected_deployments().items():
        assert name in deployments, f"{where}: deployment {name} of deploy/prefect.yaml was not deployed"
        assert deployments[name]["work_pool"] == pool
    docker = [d for d in deployments.values() if d["work_pool"] == "lmyard-docker"]
    assert docker and all(d["image"] for d in docker), f"{where}: a Docker deployment has no image"
    by_id = {d["id"]: name for name, d in deployments.items()}
    targets = [a.deployment_id for x in automations for a in x.actions if a.type == "run-deployment"]
    assert targets and all(t in by_id for t in targets), f"{where}: an automation runs a deployment that is missing"
    assert "lineage-crashed/close" in {by_id[t] for t in targets}
    names = {a.name for a in automations}
    assert "lmyard-crash-silent-flow-runs" in names, f"{where}: deploy/automations.yaml was not installed"


@pytest.mark.slow
def test_documented_command_blocks_run_as_written_and_deploy_every_deployment(tmp_path):
    """Each ```bash block's runnable lines, as one bash script from the repository root, exit 0; a block
    that deploys leaves every deployment of deploy/prefect.yaml and the crashed-run automation's target."""
    runnable = [(b[0], [c.text for c in b if not skip_reason(c)]) for b in bash_blocks()]
    runnable = [(first, lines) for first, lines in runnable if lines]
    assert any("prefect deploy" in "\n".join(lines) for _, lines in runnable)
    with prefect_server(tmp_path) as env:
        env.pop("LMYARD_IMAGE", None)  # the block itself must say which image the Docker deployment runs
        # `prefect`, `python` and `lmyard` as an operator's activated virtualenv gives them
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
        for first, lines in runnable:
            where = f"{first.doc}:{first.line}"
            script = "set -e\n" + "\n".join(lines)
            done = subprocess.run(
                ["bash", "-c", script],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, f"{where}:\n{script}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            if any(line.startswith("prefect deploy ") for line in lines):
                _assert_everything_deployed(env["PREFECT_API_URL"], where)
                _reset(env["PREFECT_API_URL"])
