"""`lmyard sweep`: model sizes and search spaces, each trial an ordinary lineage under the sweep's MLflow run.

Against a real MLflow server, a real Prefect server and (for Ray Tune) a real two-node Ray cluster on 127.0.0.1.
The size sweep runs once for the module; its rerun is the resume test.
"""

from __future__ import annotations

import json
import math
import subprocess
import uuid

import pytest
from conftest import lmyard_cmd, tiny_overrides
from mlflow.tracking import MlflowClient

TIMEOUT_S = 1800  # three or four tiny lineages, each a whole pretrain flow, on a busy 2-core machine


def _sets(tmp_path, tracking_uri: str, run_name: str, steps: int, **extra) -> list[str]:
    values = {
        "run_name": run_name,
        "tracking.uri": tracking_uri,
        "tracking.experiment": run_name,
        "model.n_embd": 32,
        "model.n_head": 2,
        "launch.nproc_per_node": 1,
        "eval.interval": 1,
        "eval.val_tokens": 512,
        "checkpoint.interval": steps,
        **extra,
    }
    return [a for s in tiny_overrides(tmp_path, steps=steps, **values) for a in ("--set", s)]


def _runs(uri: str, experiment: str) -> tuple[object, list]:
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("lmyard.sweep") == experiment]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return parents[0], sorted(children, key=lambda r: r.info.run_name)


@pytest.fixture(scope="module")
def size_sweep(tmp_path_factory, mlflow_server, prefect_api_url):
    """`lmyard sweep smoke --sizes 1,2,3` of a 2-step model once; the command, its folder, environment, result."""
    import os

    tmp = tmp_path_factory.mktemp("sizes")
    name = f"sizes-{uuid.uuid4().hex[:6]}"
    sets = _sets(tmp, mlflow_server.uri, name, steps=2, **{"eval.interval": 2})  # one evaluation: the last step's
    args = lmyard_cmd("sweep", "smoke", "--sizes", "1,2,3", *sets)
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "LMYARD_CACHE": str(tmp / "cache")}
    env.pop("PREFECT_HOME", None)
    proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return name, args, tmp, env, proc


@pytest.mark.integration
def test_a_size_sweep_trains_each_size_as_a_child_run_and_fits_loss_against_compute(size_sweep, mlflow_server):
    name, _, _, _, proc = size_sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parent, children = _runs(mlflow_server.uri, name)
    assert [c.info.run_name for c in children] == [f"{name}-x1", f"{name}-x2", f"{name}-x3"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert [c.data.params["model.n_embd"] for c in children] == ["32", "64", "96"]  # width = base * index
    assert [c.data.params["model.n_head"] for c in children] == ["2", "4", "6"]
    assert [c.data.params["model.n_layer"] for c in children] == ["2", "2", "2"]  # depth fixed
    assert parent.info.status == "FINISHED"
    assert "| trial |" in parent.data.tags["mlflow.note.content"]  # the trials' table on the parent run's page
    assert math.isfinite(parent.data.metrics["sweep/power_law_exponent"])
    client = MlflowClient(mlflow_server.uri)
    table = json.loads(open(client.download_artifacts(parent.info.run_id, "trials.json")).read())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [r["trial"] for r in rows] == [c.info.run_name for c in children]
    assert all(r["status"] == "finished" and r["step"] == 2 for r in rows)
    assert rows[0]["flops"] < rows[1]["flops"] < rows[2]["flops"]  # 6ND: N grows with the width
    assert "loss_vs_compute.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    assert not client.search_registered_models(f"name LIKE '{name}%'")  # trials register no model by default


@pytest.mark.integration
def test_a_rerun_sweep_skips_its_finished_trials(size_sweep, mlflow_server):
    name, args, tmp, env, first = size_sweep
    assert first.returncode == 0, first.stderr[-3000:]
    proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3 of 3 trials done already, 0 to train" in proc.stdout + proc.stderr
    _, children = _runs(mlflow_server.uri, name)  # still one parent run
    assert [c.data.tags["lmyard.attempts"] for c in children] == ["1", "1", "1"]  # no trial launched again


@pytest.mark.integration
def test_an_isoflop_sweep_prints_the_recommended_size_of_its_budget_and_fits_no_exponent_through_one(
    tmp_path, mlflow_server, cli_env
):
    # 3e9 FLOPs = 6 N D: 13 steps of 1,024 tokens at x1 (~37k parameters), 5 at x2, 2 at x3
    name, extra = f"iso-{uuid.uuid4().hex[:6]}", {"eval.interval": 1000, "checkpoint.interval": 1000}
    sets = _sets(tmp_path, mlflow_server.uri, name, steps=2, **extra)
    args = lmyard_cmd("sweep", "smoke", "--sizes", "1,2,3", "--budgets", "3e9", *sets)
    proc = subprocess.run(args, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("lmyard: C=3e+09 FLOPs: recommended size")]
    assert len(said) == 1 and "nearest trained size x" in said[0], proc.stdout[-3000:]
    assert "lmyard: no power law: " in proc.stdout and "a power law needs 3, no exponent fitted" in proc.stdout
    parent, children = _runs(mlflow_server.uri, name)
    steps = [int(c.data.params["train.max_steps"]) for c in children]
    assert [c.info.run_name for c in children] == [f"{name}-x{i}-c3e09" for i in (1, 2, 3)]
    assert steps[0] > steps[1] > steps[2] >= 1, steps  # one budget: the smaller model, the more steps
    assert "sweep/optimal_params_exponent" not in parent.data.metrics  # one budget: no exponent logged
    assert "Compute-optimal size:" in parent.data.tags["mlflow.note.content"]
    client = MlflowClient(mlflow_server.uri)
    assert "loss_vs_compute.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]


@pytest.mark.integration
def test_a_tune_search_on_ray_stops_a_bad_trial_before_its_last_step(ray_cluster, mlflow_server, cli_env, tmp_path):
    from lmyard.sweep.record import STOPPED_TAG

    # 120 steps: the 112 after the first rung give a stop time to land (1-2 s here; a poll of 2 s, then SIGTERM)
    steps, name = 120, f"search-{uuid.uuid4().hex[:6]}"
    (tmp_path / "space.yaml").write_text(
        "params:\n  train.lr: {grid: [0.01, 0.005, 1.0e-7, 1.0e-8]}\n"
        "scheduler: {asha: {grace_steps: 8, reduction_factor: 2}}\n"
    )
    on_ray = {"launch.backend": "ray", "launch.nnodes": 1, "eval.interval": 8}
    sets = _sets(tmp_path, mlflow_server.uri, name, steps=steps, **on_ray)
    args = lmyard_cmd("sweep", "smoke", "--search", "space.yaml", *sets)
    env = {**cli_env, "RAY_ADDRESS": ray_cluster.address}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, children = _runs(mlflow_server.uri, name)
    assert len(children) == 4
    client = MlflowClient(mlflow_server.uri)
    last = {
        c.info.run_name: max(m.step for m in client.get_metric_history(c.info.run_id, "loss/val")) for c in children
    }
    stopped = {c.info.run_name: int(c.data.tags[STOPPED_TAG]) for c in children if STOPPED_TAG in c.data.tags}
    # the tag is the scheduler's decision at a rung (8, 16, 32, ...): two trials run at once on the 2 CPUs, so
    # the second pair meets the first pair's recorded losses, and lr 1e-7 or 1e-8 is worse at a rung
    assert any(at < steps for at in stopped.values()), (last, stopped)
    # and the trial's process ran on only until its SIGTERM landed: it did not train to its end
    assert any(last[n] < steps for n in stopped), (last, stopped)
    assert any(c.info.status == "FINISHED" and last[c.info.run_name] == steps for c in children), last


@pytest.mark.integration
def test_a_trial_that_fails_for_a_user_error_ends_the_sweep_with_exit_2_in_one_line_naming_it(cli_env, tmp_path):
    (tmp_path / "space.yaml").write_text("params:\n  train.lr: {grid: [0.01]}\n")
    name = f"userr-{uuid.uuid4().hex[:6]}"
    sets = _sets(
        tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", name, steps=2, **{"model.init_from": "models:/nope/1"}
    )
    proc = subprocess.run(
        lmyard_cmd("sweep", "smoke", "--search", "space.yaml", *sets),
        cwd=tmp_path,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lmyard: error: trial {name}-t00 failed (exit 2): lmyard: error: model.init_from"), last
    assert "no such registered model version" in last and "Traceback" not in proc.stdout + proc.stderr
    assert (tmp_path / "cache" / "sweeps" / name / f"{name}-t00.log").exists()  # the trial's whole output kept
