"""The restart to the first step's end, in parts (lmyard.train.components.Startup): a real run of the train stage
under torchrun logs them once to its MLflow run and in one line, each non-negative, summing to the total; after an
interrupted and resumed run the lineage's run holds each attempt's parts and its goodput, and `lmyard status`
reports them (lmyard.train.components.Goodput)."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import tiny_overrides

from flows.cli import main
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import Preempted
from lmyard.launch.follower import stop_all
from lmyard.launch.local_job import run_local
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.tracking.lineage import Lineage
from lmyard.train.components import Startup

PARTS = Startup.PARTS


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
    lineage = Lineage.open(cfg, Run.of(cfg), shard_address=shards.address, code_version="test")
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": lineage.to_dict()}
    lines: list[str] = []
    started = time.time()
    run_local(cfg, spec, on_line=lines.append)
    took = time.time() - started

    client = MlflowClient(mlflow_server.uri)
    times = {}
    for part in (*PARTS, "total"):
        history = client.get_metric_history(lineage.ref.mlflow_run_id, f"system/restart/{part}_s")
        assert [m.step for m in history] == [1], f"system/restart/{part}_s logged at steps {[m.step for m in history]}"
        times[part] = history[0].value
    assert all(v >= 0 for v in times.values()), times
    assert times["torchrun"] > 0 and times["imports"] > 0 and times["model"] > 0, times  # measured, not left at 0
    assert times["first_step"] > 0, times
    named = sum(times[p] for p in PARTS if p != "other")
    assert named <= times["total"] + 1e-6 and sum(times[p] for p in PARTS) == pytest.approx(times["total"]), times
    assert times["total"] <= took  # the launcher's time is the start: within what this test waited
    [line] = [ln for ln in lines if ln.startswith("startup to the end of step 1:")]
    assert "(launch from launcher's start)" in line
    assert re.search(r"compile [\d.]+ s \+ first step [\d.]+ s", line), line


@pytest.mark.integration
def test_an_interrupted_and_resumed_run_holds_each_attempts_restart_and_its_goodput_and_status_reports_them(
    tmp_path, monkeypatch, capsys
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LMYARD_FAULTS", "pause@3")  # the ranks pause after step 3: the SIGTERM lands there
    monkeypatch.setenv("LMYARD_FAULT_PAUSE_S", "8")
    extra = {"train.compile": "false", "tracking.system_metrics": "false", "eval.interval": 100}
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=6, **extra))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    lineage = Lineage.open(cfg, Run.of(cfg), shard_address=shards.address, code_version="test")

    def attempt(start_step: int, on_line) -> Lineage:
        current = lineage.record_attempt(resumed_from=None, start_step=start_step, info={})
        spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": current.to_dict()}
        run_local(cfg, spec, on_line=on_line)
        return current

    with pytest.raises(Preempted):  # SIGTERM after step 3, as a spot reclaim sends it: step 3 is committed
        attempt(0, lambda line: line.startswith("step 3/6") and stop_all())
    monkeypatch.setenv("LMYARD_FAULTS", "")
    attempt(3, lambda line: None)

    client, run_id = MlflowClient(cfg.tracking.uri), lineage.ref.mlflow_run_id
    history = client.get_metric_history(run_id, "system/restart/total_s")
    assert sorted(m.step for m in history) == [1, 4]  # each attempt's first step
    metrics = client.get_run(run_id).data.metrics
    assert 0 < metrics["system/goodput/goodput"] <= 1
    assert metrics["system/goodput/badput/start_s"] > 0 and metrics["system/goodput/badput/restart_s"] > 0
    assert metrics["system/goodput/step"] == 6 and metrics["system/goodput/steps_run"] == 6

    capsys.readouterr()
    assert main(["status", cfg.run_name, "--store", cfg.store, "--tracking-uri", cfg.tracking.uri, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    first, second = status["attempts"]
    assert (first["start_step"], second["start_step"]) == (0, 3)
    for a in (first, second):
        assert set(a["restart_s"]) == {*PARTS, "total"} and a["restart_s"]["total"] > 0, a
    assert second["restart_s"]["resume"] > 0  # it read checkpoint step 3
    g = status["goodput"]
    assert g["goodput"] == pytest.approx(metrics["system/goodput/goodput"], abs=1e-4)
    assert set(g["badput_s"]) == {"start", "restart", "steps_lost", "checkpoint", "evaluation"}
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"], rel=0.02)
