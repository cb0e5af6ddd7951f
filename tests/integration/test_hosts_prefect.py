"""A Prefect worker on another host (tests/hosts.py): the Prefect server runs in the services host, the worker in
host b, in a working folder of its own; the flow code reaches host b through the deployments' `pull:` step, a
git_clone of LMYARD_REPOSITORY (here a bare copy of this checkout's commit that the test makes).

The deployment is made and run from this machine through a forward to the server; the flow's store and tracking
file are folders by absolute path (the simulated hosts share this machine's disk).

Skipped where namespaces cannot be made (not root, no `ip`); LMYARD_REQUIRE_HOSTS=1 turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, stop_prefect_worker, wait_for_http
from hosts import Hosts, require_hosts
from test_deployments import _config, _write_corpus

from lmyard.checkpoint.catalog import complete_steps
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow
PREFECT = [sys.executable, "-m", "prefect"]
PREFECT_PORT = 4200


@pytest.fixture(scope="module")
def worker_hosts(tmp_path_factory):
    require_hosts()
    harness = Hosts(tmp_path_factory.mktemp("worker-hosts"), ["b"])
    with harness:
        yield harness
    assert harness.leftovers() == []


def test_a_worker_on_host_b_runs_a_deployment_from_its_own_clone_of_the_repository(worker_hosts, tmp_path):
    svc, b = worker_hosts.services, worker_hosts["b"]
    bare = tmp_path / "lmyard.git"
    cloned = subprocess.run(["git", "clone", "-q", "--bare", str(REPO), str(bare)], capture_output=True, text=True)
    assert cloned.returncode == 0, cloned.stderr
    common = {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONUNBUFFERED": "1",
    }
    server = svc.start(
        [*PREFECT, "server", "start", "--host", svc.addr, "--port", str(PREFECT_PORT)], "prefect.log", env=common
    )
    here = {**os.environ, **common, "LMYARD_REPOSITORY": f"file://{bare}"}
    here["PREFECT_API_URL"] = f"http://127.0.0.1:{worker_hosts.forward(svc, PREFECT_PORT)}/api"
    wait_for_http(here["PREFECT_API_URL"] + "/health", server, 240, svc.root / "prefect.log")

    def prefect(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*PREFECT, *args], env=here, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    made = prefect("work-pool", "create", "lmyard-process", "--type", "process")
    assert made.returncode == 0, made.stdout + made.stderr
    deployed = prefect("--no-prompt", "deploy", "--prefect-file", "deploy/prefect.yaml", "--name", "smoke")
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]

    (workdir := b.root / "worker").mkdir()
    worker_env = {**common, "PREFECT_API_URL": f"http://{svc.addr}:{PREFECT_PORT}/api"}
    worker_env |= {"PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    cd_and_work = f"cd {workdir} && exec " + " ".join([*PREFECT, "worker", "start", "--pool", "lmyard-process"])
    worker = b.start(["sh", "-c", cd_and_work], "worker.log", env=worker_env, resolvable=True)

    try:
        corpus = tmp_path / "corpus.jsonl"
        _write_corpus(corpus, 40)
        t0 = time.perf_counter()
        params = json.dumps({"config": _config(tmp_path, corpus, 2)})
        ran = prefect(
            "deployment", "run", "pretrain/smoke", "--params", params, "--watch", "--watch-timeout", "500", timeout=600
        )
        print(f"the deployment on host b: {time.perf_counter() - t0:.0f} s")
        log = (b.root / "worker.log").read_text()
        assert ran.returncode == 0 and "Completed" in ran.stdout, ran.stdout[-2000:] + log[-4000:]
        assert complete_steps(Run("deployed", open_store(str(tmp_path / "store"))))[-1] == 2

        # the worker, in host b and outside the checkout, ran the flow from the pull step's clone
        assert "Deployment step 'git_clone' completed successfully" in log, log[-4000:]
        assert "Deployment step 'set_working_directory' completed successfully" in log, log[-4000:]
    finally:
        stop_prefect_worker(worker)  # before the harness ends the server: Prefect's worker drains forever
