"""deploy/prefect.yaml on a real Prefect server and process worker: run, then retrain twice."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, lmyard_cmd, prefect_server, stop_prefect_worker
from prefect import flow

from lmyard.checkpoint.catalog import complete_steps
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow
PREFECT = [sys.executable, "-m", "prefect"]


@pytest.fixture(scope="module")
def prefect_stack(tmp_path_factory):
    """A Prefect server (sqlite) and a worker on the lmyard-process pool, with the repo's deployments. The worker
    works in a folder of its own, not this checkout: each flow run clones the repository (a bare copy of this
    checkout's commit, LMYARD_REPOSITORY) through the deployments' `pull:` step, as a worker on another machine
    would."""
    tmp = tmp_path_factory.mktemp("prefect-stack")
    bare = tmp / "lmyard.git"
    cloned = subprocess.run(["git", "clone", "-q", "--bare", str(REPO), str(bare)], capture_output=True, text=True)
    assert cloned.returncode == 0, cloned.stderr
    (workdir := tmp / "worker").mkdir()
    procs = []
    with prefect_server(tmp) as env:
        env.update(
            {
                "PREFECT_WORKER_QUERY_SECONDS": "1",
                "PREFECT_WORKER_PREFETCH_SECONDS": "1",
                "LMYARD_IMAGE": "lmyard-stage:test",
                "LMYARD_REPOSITORY": f"file://{bare}",
            }
        )
        try:
            run = lambda *args: subprocess.run(
                [*PREFECT, *args],
                env=env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
            )
            for pool, kind in (("lmyard-process", "process"), ("lmyard-docker", "docker")):
                created = run("work-pool", "create", pool, "--type", kind)
                assert created.returncode == 0, created.stdout + created.stderr
            deployed = run("--no-prompt", "deploy", "--all", "--prefect-file", "deploy/prefect.yaml")
            assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
            automations = run("automation", "create", "--from-file", "deploy/automations.yaml")
            assert automations.returncode == 0, automations.stdout[-3000:] + automations.stderr[-3000:]
            worker_log = tmp / "worker.log"

            def start_worker() -> subprocess.Popen:
                worker = subprocess.Popen(
                    [*PREFECT, "worker", "start", "--pool", "lmyard-process"],
                    env=env,
                    cwd=workdir,  # not the checkout: the flow code comes from the pull step's clone
                    stdout=open(worker_log, "a"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                procs.append(worker)
                return worker

            start_worker()
            yield tmp, run, worker_log, start_worker, env
        finally:
            for p in reversed(procs):
                stop_prefect_worker(p)


def test_every_deployment_names_a_recipe_that_loads_and_sets_nothing_that_disagrees_with_it():
    import yaml

    from lmyard.config import RunConfig
    from lmyard.recipes import load_recipe, with_recipe

    spec = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    for d in spec["deployments"]:
        if d["entrypoint"] == "flows/crashed.py:lineage_crashed":  # closes other runs' lineages: no config
            continue
        params = d.get("parameters", {})
        assert params.get("recipe"), f"deployment {d['name']} does not name its recipe"
        recipe = load_recipe(params["recipe"])
        given = RunConfig.model_validate(params.get("config", {}))
        assert with_recipe(given, params["recipe"]) == recipe, (
            f"deployment {d['name']} sets config fields that differ from recipe {params['recipe']}"
        )


def test_a_runs_config_overrides_only_the_fields_it_sets_on_top_of_the_recipe():
    from lmyard.config import RunConfig
    from lmyard.recipes import load_recipe, with_recipe

    given = RunConfig.model_validate({"run_name": "mine", "train": {"max_steps": 7}})
    cfg = with_recipe(given, "gpt2-124m")
    recipe = load_recipe("gpt2-124m")
    assert cfg.run_name == "mine" and cfg.train.max_steps == 7
    assert cfg.train.batch_tokens == recipe.train.batch_tokens and cfg.model.preset == "gpt2-124m"
    assert with_recipe(given, None) is given


def _config(tmp: Path, corpus: Path, steps: int) -> dict:
    return {
        "run_name": "deployed",
        "store": str(tmp / "store"),
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}"},
        "data": {"source": str(corpus)},
        "model": {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64},
        "train": {"max_steps": steps, "batch_tokens": 1024, "micro_batch": 4, "warmup_steps": 2, "log_interval": 2},
        "eval": {"interval": 4, "val_tokens": 2048, "sample_tokens": 8},
        "checkpoint": {"interval": 4},
    }


def _write_corpus(path: Path, n: int) -> None:
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)][:n]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_deployment_runs_and_scheduled_retraining_continues_only_on_new_data(prefect_stack, killed_worker):
    """Three deployment runs on the worker started in place of the killed one (`killed_worker`); the first one's
    rank 1 crashes once, and its retry resumes."""
    tmp, run, worker_log, _, env = prefect_stack
    corpus = tmp / "corpus.jsonl"
    _write_corpus(corpus, 40)
    store = open_store(str(tmp / "store"))

    # rank 1 crashes after step 6 in the first attempt (once: the fault's state folder); the retry resumes at 4
    crash = {
        "LMYARD_FAULTS": "crash_last@6",
        "LMYARD_FAULTS_STATE": str(tmp / "faults-deployed"),
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",  # the pool's own env, which a run's env replaces
    }
    first = run(
        "deployment",
        "run",
        "pretrain/smoke",
        "--params",
        json.dumps({"config": _config(tmp, corpus, 8)}),
        "--job-variable",
        f"env={json.dumps(crash)}",
        "--watch",
        "--watch-timeout",
        "400",
    )
    assert first.returncode == 0 and "Completed" in first.stdout, first.stdout[-2000:] + worker_log.read_text()[-4000:]
    assert complete_steps(Run("deployed", store))[-1] == 8
    _the_crashed_attempt_is_said_once_and_linked(tmp, run, env, re.search(r"UUID: ([0-9a-f-]{36})", first.stdout)[1])
    # the flow ran from the pull step's clone (the worker works outside this checkout): its steps are in the log,
    # under its flow run's name (the log holds the killed run's steps too)
    name = re.search(r"Created flow run '([^']+)'", first.stdout).group(1)
    log = worker_log.read_text()
    assert f"Flow run '{name}' - Deployment step 'git_clone' completed successfully" in log, log[-4000:]
    assert f"Flow run '{name}' - Deployment step 'set_working_directory' completed successfully" in log

    _write_corpus(corpus, 60)  # new documents appended
    params = {"config": _config(tmp, corpus, 8), "extra_steps": 4}
    second = run(
        "deployment",
        "run",
        "retrain/smoke-retrain",
        "--params",
        json.dumps(params),
        "--watch",
        "--watch-timeout",
        "400",
    )
    assert second.returncode == 0 and "Completed" in second.stdout, (
        second.stdout[-2000:] + worker_log.read_text()[-4000:]
    )
    assert complete_steps(Run("deployed", store))[-1] == 12
    log = worker_log.read_text()
    assert "retraining deployed: continue (new data" in log
    assert "resuming from" in log and "continuing at the first sequence past its" in log

    third = run(
        "deployment",
        "run",
        "retrain/smoke-retrain",
        "--params",
        json.dumps(params),
        "--watch",
        "--watch-timeout",
        "400",
    )
    assert third.returncode == 0 and "Completed" in third.stdout, third.stdout[-2000:] + worker_log.read_text()[-4000:]
    assert complete_steps(Run("deployed", store))[-1] == 12
    assert "retraining deployed: none (no new data" in worker_log.read_text()


def _the_crashed_attempt_is_said_once_and_linked(tmp: Path, run, env: dict, flow_run_id: str) -> None:
    """The first attempt's train task log: rank 1's crash said once, in one line, with no MLflow INFO line, no
    download bar, no other rank's traceback, in at most 60 lines; `lmyard status` names the crash; the MLflow run
    links the flow run, the flow run's summary links the MLflow run."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        logs: list = []
        while len(logs) % 200 == 0:  # the API's pages: 200 records at most
            page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), 200, len(logs))
            logs += page
            if not page:
                break
        summaries = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["deployed-summary"]))
        )
    (summary,) = [a for a in summaries if str(a.flow_run_id) == flow_run_id]
    train_runs = {g.task_run_id for g in logs if g.message.startswith("attempt 1 of lineage deployed")}
    assert len(train_runs) == 1, [g.message for g in logs]
    ours = sorted((g for g in logs if g.task_run_id in train_runs), key=lambda g: g.timestamp)
    end = next(i for i, g in enumerate(ours) if g.message.startswith("Task run failed with exception"))
    attempt = [ln for g in ours[: end + 1] for ln in g.message.splitlines()]
    text = "\n".join(attempt)
    said = re.compile(r"train: rank 1 exited with code 1 first: injected crash of rank 1 after step 6; rank 0 failed")
    assert len(said.findall(text)) == 1, text  # in Prefect's retry line; the follower's error is that exception
    for noise in ("INFO mlflow", "system metrics", "Downloading artifacts", "Traceback", "Connection reset", "gloo"):
        assert noise not in text, f"{noise!r} in the failed attempt's log:\n{text}"
    assert len(attempt) <= 60, f"{len(attempt)} lines:\n{text}"
    print(f"the failed attempt's train task log: {len(attempt)} lines")

    status = subprocess.run(
        [
            *lmyard_cmd("status", "deployed"),
            "--store",
            str(tmp / "store"),
            "--tracking-uri",
            f"sqlite:///{tmp / 'mlflow.db'}",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    (line,) = [ln for ln in status.stdout.splitlines() if ln.strip().startswith("attempt 1:")]
    assert said.search(line) and not line.rstrip().endswith(":"), status.stdout

    run_id = json.loads((tmp / "store" / "runs" / "deployed" / "lineage.json").read_text())["mlflow_run_id"]
    tags = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}").get_run(run_id).data.tags
    ui = env["PREFECT_API_URL"].removesuffix("/api")
    assert tags["lmyard.attempt.1.flow_run_url"] == f"{ui}/runs/flow-run/{flow_run_id}"
    assert tags["lmyard.attempt.2.flow_run_url"] == f"{ui}/runs/flow-run/{flow_run_id}"
    assert re.search(rf"\[MLflow run {run_id}\]\(http://[^)]*/#/experiments/\d+/runs/{run_id}\)", summary.data), (
        summary.data
    )


def _flow_run(api_url: str, flow_run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def _wait(what: str, check, timeout_s: float, poll_s: float = 2.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


KILLED_AT = 250  # the killed run's first checkpoint: the next run resumes from it


def _crash_config(tmp: Path, corpus: Path, steps: int) -> dict:
    return {
        **_config(tmp, corpus, steps),
        "run_name": "worker-killed",
        "checkpoint": {"interval": KILLED_AT},
        "eval": {"interval": KILLED_AT, "val_tokens": 2048, "sample_tokens": 8},
    }


@pytest.fixture(scope="module")
def killed_worker(prefect_stack):
    """The worker killed mid-run (SIGKILL, with its flow run's process) once the run's first checkpoint is
    committed, and a new worker started: (flow run id, store). Made before the deployment runs of this module, so
    that the heartbeat automation's 90 s pass while they run on the new worker instead of in a wait of their own."""
    import psutil

    tmp, run, _, start_worker, _ = prefect_stack
    corpus = tmp / "crash-corpus.jsonl"
    _write_corpus(corpus, 40)
    store = open_store(str(tmp / "store"))
    # far more steps than the time the kill takes: the run is still training when it comes
    config = _crash_config(tmp, corpus, 1000)
    started = run("deployment", "run", "pretrain/smoke", "--params", json.dumps({"config": config}))
    assert started.returncode == 0, started.stdout + started.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    _wait("the first checkpoint", lambda: complete_steps(Run("worker-killed", store)), 300, 0.2)

    (worker,) = [p for p in psutil.Process().children() if "worker" in p.cmdline() and "lmyard-process" in p.cmdline()]
    for victim in [worker, *worker.children(recursive=True)]:  # the machine dies: the worker and the flow run
        victim.kill()
    start_worker()
    return flow_run_id, store


def test_a_killed_worker_leaves_a_crashed_flow_run_a_failed_mlflow_run_and_the_next_run_resumes(
    prefect_stack, killed_worker
):
    """A worker killed mid-run (SIGKILL, with its flow run's process): the heartbeat automation marks the flow run
    Crashed, the Crashed event's deployment marks the lineage's MLflow run FAILED, and the next run resumes."""
    from mlflow.tracking import MlflowClient

    tmp, run, worker_log, _, env = prefect_stack
    flow_run_id, store = killed_worker
    assert complete_steps(Run("worker-killed", store)) == [KILLED_AT]  # killed before the run's next checkpoint

    api = env["PREFECT_API_URL"]
    state = _wait(
        "the flow run to be marked Crashed",
        lambda: (s := _flow_run(api, flow_run_id).state) and s.is_crashed() and s,
        300,
    )
    assert "no heartbeat" in (state.message or "")
    run_id = json.loads(store.read_bytes("runs/worker-killed/lineage.json"))["mlflow_run_id"]
    mlflow = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    _wait("the MLflow run to end FAILED", lambda: mlflow.get_run(run_id).info.status == "FAILED", 180)

    # the next run, a few steps past the checkpoint it resumes from
    config = _crash_config(tmp, tmp / "crash-corpus.jsonl", KILLED_AT + 4)
    again = run(
        "deployment",
        "run",
        "pretrain/smoke",
        "--params",
        json.dumps({"config": config}),
        "--watch",
        "--watch-timeout",
        "400",
    )
    assert again.returncode == 0 and "Completed" in again.stdout, again.stdout[-2000:] + worker_log.read_text()[-4000:]
    tags = mlflow.get_run(run_id).data.tags
    assert tags["lmyard.attempts"] == "2" and tags["lmyard.attempt.2.resumed_from"].endswith(f"step_{KILLED_AT:08d}")
    assert mlflow.get_run(run_id).info.status == "FINISHED"
    assert complete_steps(Run("worker-killed", store))[-1] == KILLED_AT + 4


@flow(name="another-teams-flow")
def _another_teams_flow() -> None:
    """A flow of someone else's on the same Prefect server: never run, only its flow runs are made."""


def test_a_crash_of_another_teams_flow_run_triggers_nothing_of_lmyards_and_an_lmyard_crash_still_does(prefect_stack):
    """On a shared server lmyard's automations act on flow runs tagged `lmyard` only: a foreign flow run that
    crashes starts no `close` run, an lmyard-tagged one does (unscoped, both did)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    *_, env = prefect_stack
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        close = client.read_deployment_by_name("lineage-crashed/close")
        foreign = client.create_flow_run(_another_teams_flow, tags=["another-team"])
        ours = client.create_flow_run(_another_teams_flow, tags=["lmyard"])
        for run_ in (foreign, ours):
            client.set_flow_run_state(run_.id, Crashed(message="its process died"), force=True)

        def closes() -> list[str]:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[close.id])))
            return [str(r.parameters.get("flow_run_id", "")) for r in runs]

        _wait("the close run of the lmyard flow run's crash", lambda: any(str(ours.id) in c for c in closes()), 120)
        # the triggers handle events in no set order: watch a while longer for a close of the foreign crash
        with pytest.raises(AssertionError, match="timed out"):
            _wait("a close run of the foreign crash", lambda: any(str(foreign.id) in c for c in closes()), 20, 1)
