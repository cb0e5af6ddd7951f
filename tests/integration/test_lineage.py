"""One MLflow run per lineage, through a killed and retried training job: a real `mlflow server`
(sqlite, artifacts in the S3 test server), the Prefect test server, checkpoints on S3."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, tiny_overrides
from mlflow.tracking import MlflowClient

from lmyard.checkpoint.catalog import complete_steps
from lmyard.layout import RunLayout
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow
HELLASWAG = REPO / "tests" / "fixtures" / "hellaswag_tiny.jsonl"


def _kill_training_after(
    store, run_name: str, tracking_uri: str, step: int, killed: list[int], timeout: float = 300
) -> None:
    """SIGKILL the trainer (torchrun and its ranks) mid-run: once the checkpoint of `step` exists and MLflow
    holds loss/train past it, so the next attempt repeats steps the first one logged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        steps = complete_steps(Run(run_name, store))
        if not steps or steps[-1] < step:
            continue
        run_id = json.loads(store.read_bytes(f"runs/{run_name}/lineage.json"))["mlflow_run_id"]
        logged = {m.key: m.step for m in MlflowClient(tracking_uri).get_run(run_id).data.to_proto().metrics}
        if logged.get("loss/train", 0) <= steps[-1]:
            continue
        for proc in psutil.Process().children(recursive=True):
            try:
                if "lmyard.launch.torchrun" in " ".join(proc.cmdline()):
                    for victim in [proc, *proc.children(recursive=True)]:
                        victim.send_signal(signal.SIGKILL)
                    killed.append(complete_steps(Run(run_name, store))[-1])
                    return
            except psutil.NoSuchProcess:
                pass


def test_killed_training_is_retried_as_one_mlflow_run_with_two_attempts(
    prefect_api_url, mlflow_server, s3_server, s3_bucket, tmp_path, monkeypatch
):
    from flows.pretrain import pretrain

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    run_name = "killed-and-retried"
    cfg = load_recipe(
        "smoke",
        tiny_overrides(
            tmp_path,
            steps=200,
            **{
                "store": f"s3://{s3_bucket}/store",
                "run_name": run_name,
                "tracking.uri": mlflow_server.uri,
                "tracking.experiment": "lineage-tests",
                "tracking.registered_model": run_name,
                "tracking.system_metrics_interval_s": 1,
                "launch.retries": 1,
                "launch.nproc_per_node": 1,
                "train.threads_per_rank": 1,
                "checkpoint.interval": 50,
                "eval.interval": 50,
                "train.log_interval": 1,
                "eval.threads": 1,
                "eval.poll_s": 0.5,
                "eval.hellaswag": str(HELLASWAG),
                "eval.gates.val_loss_max": 50,
                "checkpoint.keep_last": 2,
            },
        ),
    )
    store = open_store(cfg.store)
    killed: list[int] = []
    killer = threading.Thread(
        target=_kill_training_after, args=(store, run_name, cfg.tracking.uri, 50, killed), daemon=True
    )
    killer.start()
    summary = pretrain(config=cfg)
    killer.join(timeout=5)
    assert killed, "the trainer was never killed"
    resumed_at = killed[-1]
    assert 50 <= resumed_at < 200

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id], f"tags.`lmyard.run_name` = '{run_name}'")) == 1

    # two attempts of the same flow run: the second resumed from the checkpoint the first left
    tags = run.data.tags
    assert tags["lmyard.attempts"] == "2" and summary.attempts == 2
    assert tags["lmyard.attempt.1.start_step"] == "0" and tags["lmyard.attempt.1.resumed_from"] == ""
    assert tags["lmyard.attempt.1.outcome"].startswith("failed")
    assert tags["lmyard.attempt.2.start_step"] == str(resumed_at)
    assert tags["lmyard.attempt.2.resumed_from"] == store.uri(RunLayout(run_name).step(resumed_at))
    assert tags["lmyard.attempt.2.outcome"] == "finished: step 200"
    assert tags["lmyard.attempt.1.flow_run_id"] == tags["lmyard.attempt.2.flow_run_id"] != ""
    assert (tags["lmyard.attempt.1.task_run_count"], tags["lmyard.attempt.2.task_run_count"]) == ("1", "2")
    assert tags["lmyard.attempt.2.nodes"] == "1"

    # a continuous loss history: every step once, though the second attempt repeated some
    losses = client.get_metric_history(run.info.run_id, "loss/train")
    assert sorted(m.step for m in losses) == list(range(1, 201))

    # every checkpoint evaluated, at its step; the evaluator's val loss is the trainer's own
    val = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/val")}
    evaluated = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/eval")}
    assert sorted(evaluated) == [50, 100, 150, 200]
    assert evaluated == {s: pytest.approx(val[s], rel=1e-5) for s in evaluated}
    # retention ran in the flow after each evaluation: the last two and the best are left, each evaluated
    best = min(evaluated, key=lambda s: (val[s], -s))  # the trainer's val loss, as in the manifests
    assert complete_steps(Run(run_name, store)) == sorted({150, 200, best})
    assert all(
        store.exists(f"{RunLayout(run_name).step(s)}/evaluated.json") for s in complete_steps(Run(run_name, store))
    )
    acc_norm = client.get_metric_history(run.info.run_id, "task/hellaswag_acc_norm")
    assert sorted(m.step for m in acc_norm) == [50, 100, 150, 200]
    assert all(0 <= m.value <= 1 for m in acc_norm)
    # system metrics come from inside the trainer, one series per node, continued (not restarted) by the retry
    cpu = [m.step for m in client.get_metric_history(run.info.run_id, "system/node0/cpu_utilization_percentage")]
    assert cpu and len(cpu) == len(set(cpu))

    # artifacts in the S3-backed artifact store; checkpoints only referenced by URI
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "shards", "evals", "plots", "summary.json", "attempts.json"} <= top
    path = client.download_artifacts(run.info.run_id, "evals/checkpoints.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    rows = {r["step"]: r for r in (dict(zip(table["columns"], data)) for data in table["data"])}
    assert sorted(rows) == [50, 100, 150, 200]  # one table, a row per evaluated checkpoint
    for s, row in rows.items():
        assert row["checkpoint"] == store.uri(RunLayout(run_name).step(s))
        assert row["val_loss"] == pytest.approx(val[s], rel=1e-5)
    path = client.download_artifacts(run.info.run_id, "evals/samples.json", str(tmp_path))
    samples = json.loads(Path(path).read_text())
    assert sorted({row[samples["columns"].index("step")] for row in samples["data"]}) == [50, 100, 150, 200]
    assert not any(a.path.endswith(".pt") for a in client.list_artifacts(run.info.run_id, "evals"))

    # the registered version is the final checkpoint's export, logged in the S3 artifact store; the gate
    # passed, so it is the candidate
    version = client.get_model_version_by_alias(run_name, "candidate")
    assert version.source.startswith("models:/m-")
    assert version.tags["lmyard.checkpoint"] == store.uri(RunLayout(run_name).step(200)) == summary.checkpoint
    assert version.run_id == run.info.run_id
    assert json.loads(store.read_bytes(f"runs/{run_name}/protected.json")) == {"steps": [200]}

    # Prefect: an eval table per checkpoint and training progress at 100%
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as pc:
        keys = [f"{run_name}-eval-step-{s:08d}" for s in (50, 100, 150, 200)] + [f"{run_name}-train-progress"]
        found = {}  # the newest of each key: each attempt of the train task makes its own progress artifact
        for a in sorted(
            pc.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys))), key=lambda a: a.created
        ):
            found[a.key] = a
    assert set(found) == set(keys)
    assert found[f"{run_name}-train-progress"].data == 100.0


def _save_tiny_checkpoint(store, run_name: str, step: int, staging) -> str:
    import torch
    from checkpoint_helpers import save_full

    state = {"step": step, "val_loss": None, "cursor": step, "tokens_seen": step, "world_size": 1}
    state |= {"shard_address": "a", "config": {}, "model": {}}
    return save_full(Run(run_name, store), step, {"w": torch.zeros(2)}, {}, [], state, str(staging))


def test_checkpoint_metrics_are_logged_once_per_checkpoint_across_reruns(prefect_api_url, mlflow_server, tmp_path):
    """A rerun (or a retry) of the checkpoint stage for a checkpoint already recorded logs nothing
    again; a checkpoint trained again at the same step after a fallback is another checkpoint, recorded."""
    from lmyard.checkpoint.catalog import quarantine
    from lmyard.tracking import bookkeeping
    from lmyard.tracking.lineage import Lineage
    from tasks.checkpoint import record_checkpoint

    overrides = [f"store={tmp_path / 'store'}", f"tracking.uri={mlflow_server.uri}", "run_name=recorded-once"]
    cfg = load_recipe("smoke", overrides)
    store = open_store(cfg.store)
    lineage = Lineage.open(cfg, Run(cfg.run_name, store), shard_address="a" * 64, code_version="test")
    for step in (2, 4):
        _save_tiny_checkpoint(store, cfg.run_name, step, tmp_path / "stage")
        record_checkpoint(cfg, lineage, step)
    for step in (2, 4):  # the rerun of the lineage, and a retry of the task, record the same checkpoints again
        record_checkpoint(cfg, lineage, step)
        record_checkpoint(cfg, lineage, step)

    client = MlflowClient(mlflow_server.uri)
    assert sorted(m.step for m in client.get_metric_history(lineage.ref.mlflow_run_id, "system/checkpoint/bytes")) == [
        2,
        4,
    ]
    assert [len(bookkeeping.recorded(lineage, s)) for s in (2, 4)] == [1, 1]
    assert client.get_metric_history(lineage.ref.mlflow_run_id, "checkpoint/committed") == []  # no timestamp metric

    quarantine(Run(cfg.run_name, store), 4)  # the fallback: step 4 moved aside, then trained again
    _save_tiny_checkpoint(store, cfg.run_name, 4, tmp_path / "stage2")
    record_checkpoint(cfg, lineage, 4)
    record_checkpoint(cfg, lineage, 4)
    assert len(set(bookkeeping.recorded(lineage, 4))) == 2 and len(bookkeeping.recorded(lineage, 2)) == 1
