"""The restart to the first step's end, in parts (lmyard.train.components.Startup): a real run of the train stage
under torchrun logs them once to its MLflow run and in one line, each non-negative, summing to the total."""

from __future__ import annotations

import re
import time

import psutil
import pytest
from conftest import tiny_overrides

from lmyard.data.sharding import tokenize_and_shard
from lmyard.launch.follower import run_local
from lmyard.recipes import load_recipe
from lmyard.stages.startup import LAUNCHED_AT_ENV, launched_at
from lmyard.store import open_store
from lmyard.tracking.lineage import Lineage

PARTS = ("launch", "rendezvous", "resume", "compile", "first_step", "other")


@pytest.mark.integration
def test_startup_parts_are_logged_once_non_negative_and_sum_to_no_more_than_the_total(
    mlflow_server, tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    extra = {
        "run_name": "startup",
        "tracking.uri": mlflow_server.uri,
        "launch.nproc_per_node": 1,
        "train.compile": "false",
        "tracking.system_metrics": "false",
        "eval.interval": 100,
    }
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=3, **extra))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    lineage = Lineage.open(cfg, open_store(cfg.store), shard_address=shards.address, code_version="test")
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": lineage.to_dict()}
    lines: list[str] = []
    started = time.time()
    run_local(cfg, spec, on_line=lines.append)
    took = time.time() - started

    client = MlflowClient(mlflow_server.uri)
    times = {}
    for part in (*PARTS, "total"):
        history = client.get_metric_history(lineage.ref.mlflow_run_id, f"system/startup/{part}_s")
        assert [m.step for m in history] == [2], f"system/startup/{part}_s logged at steps {[m.step for m in history]}"
        times[part] = history[0].value
    assert all(v >= 0 for v in times.values()), times
    assert times["launch"] > 0 and times["first_step"] > 0, times  # measured, not left at zero
    named = sum(times[p] for p in PARTS if p != "other")
    assert named <= times["total"] + 1e-6 and sum(times[p] for p in PARTS) == pytest.approx(times["total"]), times
    assert times["total"] <= took  # the launcher's time is the start: within what this test waited
    [line] = [ln for ln in lines if ln.startswith("startup to the end of step 1:")]
    assert "(launch from launcher's start)" in line
    assert re.search(r"compile [\d.]+ s \+ first step [\d.]+ s", line), line


def test_launch_time_is_the_launchers_else_this_process_start(monkeypatch):
    monkeypatch.setenv(LAUNCHED_AT_ENV, "1234.5")
    assert launched_at() == (1234.5, "launcher")
    monkeypatch.delenv(LAUNCHED_AT_ENV)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launched_at() == (psutil.Process().create_time(), "process")
