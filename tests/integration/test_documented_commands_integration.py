"""The shell blocks of the README and docs/*.md, run as written against a real Prefect server.

A shell block's lines run as one bash script (so `IMAGE=$(...)` carries to the next line), less the lines SKIP
(tests/documented_commands_helpers.py) matches with a reason; the checks of the blocks, their markers and the
Python blocks: tests/unit/house/test_documented_commands.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, prefect_server
from docblocks import Command
from documented_commands_helpers import SKIP, _expected_deployments, bash_blocks


def skip_reason(command: Command) -> str | None:
    return next((why for pattern, why in SKIP if re.match(pattern, command.text)), None)


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
