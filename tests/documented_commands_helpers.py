"""The documented commands' tests' shared parts: which commands they do not run and why (SKIP), the
docs' shell blocks, the deployments deploy/prefect.yaml defines."""

from __future__ import annotations

from conftest import REPO
from docblocks import DOCS, SHELL, Block, Command, blocks

# (regex matched at the start of a command, why the test does not run it). Every entry must match
# some documented command, so that the list cannot go stale.
SKIP: list[tuple[str, str]] = [
    (r"python3 -m venv ", "creates a virtualenv and installs packages; the tests run in an installed one"),
    (r"apt-get install ", "changes the machine's packages"),
    (r"pip install ", "changes the virtualenv's packages (an extra's tests skip, saying so, when it is missing)"),
    (r"\.venv/bin/ruff check ", "the checks CI runs (.ci/run), in the virtualenv the line before creates"),
    (r"\.venv/bin/python -m pytest", "the test suite itself (the unit tier, then the integration tier; CI runs it)"),
    (
        r"prefect worker start ",
        "blocks: a worker serves until stopped (tests/integration/test_deployments.py starts one)",
    ),
    (r"ray start ", "starts a Ray node on a host (tests/integration/test_hosts_ray.py starts them in simulated hosts)"),
    (
        r"cd \S+ && PREFECT_API_URL=\S+ prefect worker start ",
        "blocks: a worker on another host (tests/integration/test_hosts_prefect.py)",
    ),
    (r"prefect deployment run ", "starts a training run (tests/integration/test_deployments.py runs the deployments)"),
    (r"(\.venv/bin/)?mlflow (ui|server) ", "blocks: a server runs until stopped"),
    (r"lmyard run gpt2-124m --set run_name=gpt2-quickstart ", "needs a GPU"),
    (r"lmyard (run|shard) ", "a training run; its recipe and --set overrides are checked with `lmyard config`"),
    (r"lmyard (eval|sample) ", "needs a trained checkpoint (tests/integration/test_ops.py evaluates and samples one)"),
    (r"python -m flows\.notifications ", "needs a webhook (tests/integration/test_promotion.py runs one on 127.0.0.1)"),
    (
        r"lmyard sweep ",
        "trains a lineage per trial, minutes (tests/integration/test_sweeps_integration.py runs sweeps of sizes and a search)",
    ),
    (r"lmyard export ", "needs a trained checkpoint (tests/integration/test_export_integration.py exports one)"),
    (
        r"python -m lmyard\.launch\.images build",
        "builds the stage image for minutes (tests/integration/test_docker.py)",
    ),
    (r"python -m lmyard\.launch\.images prune", "removes Docker images of this machine"),
    (r"docker run ", "runs the stage image (tests/integration/test_docker.py builds it and runs the stages in it)"),
    (r"docker pull ", "needs an image registry; none is reachable here"),
    (
        r"kubectl ",
        "needs a Kubernetes cluster; none is here (tests/unit/launch/test_kubernetes.py validates the manifests offline)",
    ),
    (
        r"tar -C / -c ",
        "imports this machine's own root filesystem into Docker (GBs, an untagged copy left at each rerun): a GPU "
        "host's set-up, which tests/benchmarks/docker_on_gpu_host.sh runs there",
    ),
    (r"TIKTOKEN_CACHE_DIR=\S+ \S*python tests/benchmarks/", "a benchmark: long, prints figures"),
]


def shell_blocks(marked: bool = False) -> list[Block]:
    """The shell blocks of the docs: those run (with `marked`, the marked ones too)."""
    return [b for doc in DOCS for b in blocks(doc) if b.lang in SHELL and (marked or b.not_run is None)]


def bash_blocks(marked: bool = False) -> list[list[Command]]:
    return [cs for b in shell_blocks(marked) if (cs := b.commands())]


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
