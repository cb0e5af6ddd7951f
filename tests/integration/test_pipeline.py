"""The pretrain flow end to end: Prefect server, trainer ranks, MLflow, store."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import psutil
import pytest
from conftest import lmyard_cmd, tiny_overrides
from mlflow.tracking import MlflowClient

from lmyard.checkpoint.catalog import complete_steps
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow


def test_flow_runs_end_to_end_and_tracks_the_run(prefect_api_url, tmp_path, monkeypatch):
    from flows.pretrain import pretrain

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=6, **{"eval.gates.val_loss_max": 0.01}))
    summary = pretrain(config=cfg)

    assert summary.steps == 6
    assert complete_steps(Run(cfg.run_name, open_store(cfg.store))) == [3, 6]
    client = MlflowClient(cfg.tracking.uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "6"
    assert run.data.tags["lmyard.shard_address"] == summary.shard_address
    losses = client.get_metric_history(run.info.run_id, "loss/train")
    assert [m.step for m in losses] == [1, 2, 3, 4, 5, 6]
    val = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/val")}
    assert sorted(val) == [3, 6]
    # every checkpoint is evaluated; its val loss is the trainer's own val loss at that step
    evaluated = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/eval")}
    assert sorted(evaluated) == [3, 6]
    assert evaluated == {s: pytest.approx(val[s], rel=1e-5) for s in (3, 6)}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "summary.json", "shards", "evals", "plots", "attempts.json"} <= artifacts
    # registered at the final checkpoint, but a failed gate (val loss far above 0.01) withholds the alias
    version = client.get_model_version("smoke", "1")
    assert version.source.startswith("models:/m-")  # the exported model, logged in MLflow
    assert (
        version.tags["lmyard.checkpoint"]
        == summary.checkpoint
        == open_store(cfg.store).uri("runs/smoke/checkpoints/step_00000006")
    )
    assert summary.alias is None and client.get_registered_model("smoke").aliases == {}


def _kill_tree(proc: subprocess.Popen) -> None:
    parent = psutil.Process(proc.pid)
    for p in [*parent.children(recursive=True), parent]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def test_killed_run_resumes_from_its_checkpoint_without_retokenizing(cli_env, tmp_path):
    overrides = tiny_overrides(tmp_path, steps=400, **{"checkpoint.interval": 5, "eval.interval": 5})
    args = lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)])
    store = open_store(str(tmp_path / "store"))
    log1 = tmp_path / "first.log"
    with open(log1, "w") as out:
        proc = subprocess.Popen(args, cwd=tmp_path, env=cli_env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while not complete_steps(Run("smoke", store)) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        _kill_tree(proc)
    first = log1.read_text()
    killed_at = complete_steps(Run("smoke", store))
    assert killed_at and killed_at[-1] < 400, first[-3000:]
    assert "wrote shard set" in first

    second = subprocess.run(
        [*args[:-1], "train.max_steps=20"], cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=400
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = second.stdout + second.stderr
    # the console prints paths relative to the store (lmyard/console.py)
    assert f"resuming from runs/smoke/checkpoints/step_{killed_at[-1]:08d} at step {killed_at[-1]}" in out
    assert "already complete" in out and "tokenizing" not in out
    # what a person reads (lmyard/console.py): no torchrun banner, no doubled words, no escapes, no absolute store
    # paths; the last line says where to look next
    assert out.count("training finished at step 20") == 1 and "warning: warning:" not in out
    assert "OMP_NUM_THREADS" not in out
    assert "\x1b[" not in out
    assert str(tmp_path / "store") not in out
    # each event printed once: a line (less its time) never repeats; each evaluation's val loss once; the final
    # checkpoint's samples only (MLflow has every checkpoint's); no third-party progress bar; a short read
    events = [line[9:] for line in out.splitlines() if line[:2].isdigit() and line[8:9] == " "]
    assert len(events) == len(set(events)), [e for e in events if events.count(e) > 1]
    evaluated = [e for e in events if ": val loss " in e and e.startswith("evaluate-step-")]
    assert evaluated and len(evaluated) == len({e.split(":")[0] for e in evaluated}), evaluated
    assert {e.split(" sample after ")[0] for e in events if " sample after " in e} == {"evaluate-step-20: step 20"}
    assert "it/s]" not in out and "%|" not in out
    assert len(out.splitlines()) <= 120, out
    last = second.stdout.strip().splitlines()[-1]
    # the mlflow beside the Python that ran it (`mlflow` when PATH finds that one)
    assert re.match(r"lmyard: look at it: (\S*/)?mlflow ui --backend-store-uri sqlite:///", last), last
    assert "models:/smoke/" in last
    assert complete_steps(Run("smoke", store))[-1] == 20
    lineage = json.loads(store.read_bytes("runs/smoke/lineage.json"))
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(lineage["mlflow_run_id"])
    assert run.data.tags["lmyard.attempts"] == "2"
    assert run.data.tags["lmyard.attempt.2.start_step"] == str(killed_at[-1])
    assert run.info.status == "FINISHED"


def test_empty_corpus_fails_with_one_line_and_no_traceback(cli_env, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run(
        lmyard_cmd("shard", "smoke", "--set", f"store={tmp_path / 's'}", "--set", f"data.source={empty}"),
        cwd=tmp_path,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("lmyard: error: data.source")
    assert "holds no documents" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_failed_evaluation_is_recorded_and_does_not_fail_a_finished_training(prefect_api_url, tmp_path, monkeypatch):
    """Every evaluation fails (its HellaSwag file is missing); training finishes, the model is
    registered, and the failures are on the MLflow run and in the flow's result."""
    from flows.pretrain import pretrain

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    missing = tmp_path / "no-such-hellaswag.jsonl"
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=6, **{"eval.hellaswag": str(missing)}))
    summary = pretrain(config=cfg)

    assert summary.steps == 6 and sorted(summary.failed_evaluations) == [3, 6]
    assert all("UserError" in e and "does not exist" in e for e in summary.failed_evaluations.values())
    assert summary.val_loss is not None  # the trainer's own, since the final evaluation failed
    client = MlflowClient(cfg.tracking.uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert "does not exist" in run.data.tags["lmyard.eval_failed.step_00000006"]
    assert client.get_metric_history(run.info.run_id, "loss/eval") == []
    assert client.get_model_version("smoke", "1").tags["lmyard.checkpoint"] == summary.checkpoint
