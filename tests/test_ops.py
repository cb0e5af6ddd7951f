"""The operator commands against real servers: `lmyard runs` and `lmyard status RUN` on an S3 store with an MLflow
tracking server, after a real run; `--json` for scripts, one line and exit 2 for a lineage that is not there."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import lmyard_cmd, tiny_overrides

from lmyard.store import open_store
from lmyard.tracking import lease

pytestmark = pytest.mark.slow


def _lmyard(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(lmyard_cmd(*args), env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def finished_run(s3_server, mlflow_server, prefect_api_url, tmp_path_factory):
    """One tiny run to its end: store on S3, tracking on the MLflow server."""
    tmp = tmp_path_factory.mktemp("ops")
    store = f"s3://{s3_server.new_bucket('ops')}/lmyard"
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "LMYARD_CACHE": str(tmp / "cache"),
        "PYTHONUNBUFFERED": "1",
    }
    overrides = tiny_overrides(
        tmp, **{"store": store, "tracking.uri": mlflow_server.uri, "tracking.system_metrics": False}
    )
    _lmyard(env, "run", "smoke", *[a for o in overrides for a in ("--set", o)])
    return env, store, mlflow_server.uri


def test_runs_json_lists_each_lineage_with_its_newest_checkpoint_and_no_lease_once_it_ended(finished_run):
    env, store, _ = finished_run
    rows = json.loads(_lmyard(env, "runs", "--store", store, "--json").stdout)
    (row,) = rows
    assert row["run_name"] == "smoke" and row["newest_step"] == 6 and row["checkpoints"] >= 1
    assert row["newest_checkpoint"] == f"{store}/runs/smoke/checkpoints/step_00000006"
    assert row["lease"] is None and len(row["mlflow_run_id"]) == 32
    text = _lmyard(env, "runs", "--store", store).stdout
    assert text.startswith("smoke: step 6 (") and "not held" in text


def test_status_json_gives_the_checkpoint_attempts_last_evaluation_run_url_and_registered_version(finished_run):
    env, store, tracking = finished_run
    s = json.loads(_lmyard(env, "status", "smoke", "--store", store, "--tracking-uri", tracking, "--json").stdout)
    assert s["newest_step"] == 6 and s["tokens_seen"] == 6 * 1024
    assert s["mlflow_status"] == "FINISHED"
    assert (
        s["mlflow_run_url"]
        == f"{tracking}/#/experiments/{s['mlflow_run_url'].split('/')[-3]}/runs/{s['mlflow_run_id']}"
    )
    (attempt,) = s["attempts"]
    assert attempt["number"] == 1 and attempt["start_step"] == 0 and attempt["outcome"].startswith("finished")
    assert s["last_evaluation"]["step"] == 6 and s["last_evaluation"]["val_loss"] > 0
    assert [v["uri"] for v in s["registered_versions"]] == ["models:/smoke/1"]
    text = _lmyard(env, "status", "smoke", "--store", store, "--tracking-uri", tracking).stdout
    assert "attempt 1: from step 0, finished" in text and "registered: models:/smoke/1" in text


def test_a_lineage_held_by_a_running_flow_shows_its_holder_and_an_unknown_one_is_one_line(finished_run, tmp_path):
    env, store, tracking = finished_run
    local = tmp_path / "store"
    held = lease.acquire(open_store(str(local)), "busy", {"flow_run": "nightly (1234)"}, ttl_s=300, wait_s=0)
    try:
        (row,) = json.loads(_lmyard(env, "runs", "--store", str(local), "--json").stdout)
        assert row["run_name"] == "busy" and row["newest_step"] is None
        assert "nightly (1234)" in row["lease"]["holder"] and row["lease"]["expired"] is False
    finally:
        held.release()
    missing = _lmyard(env, "status", "nope", "--store", store, "--tracking-uri", tracking, check=False)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr
    assert "no lineage 'nope'" in missing.stderr and "lineages there: smoke" in missing.stderr


def test_a_run_initialised_from_a_registered_model_starts_at_that_models_val_loss(finished_run, tmp_path):
    """`model.init_from: models:/smoke/1` through the tracking server: the registered export's weights, one step at
    a learning rate too small to move them, give the registered run's final val loss on the same val split."""
    from mlflow.tracking import MlflowClient

    env, store, tracking = finished_run
    client = MlflowClient(tracking)
    (registered,) = client.search_model_versions("name = 'smoke'")
    final = max(client.get_metric_history(registered.run_id, "loss/eval"), key=lambda m: m.step)
    overrides = tiny_overrides(
        tmp_path,
        steps=1,
        **{
            "store": store,
            "tracking.uri": tracking,
            "run_name": "from-registry",
            "model.init_from": "models:/smoke/1",
            "train.lr": 1e-12,
            "tracking.system_metrics": False,
        },
    )
    _lmyard(env, "run", "smoke", *[a for o in overrides for a in ("--set", o)])
    status = json.loads(
        _lmyard(env, "status", "from-registry", "--store", store, "--tracking-uri", tracking, "--json").stdout
    )
    assert status["last_evaluation"]["step"] == 1
    assert abs(status["last_evaluation"]["val_loss"] - final.value) < 1e-5, (status["last_evaluation"], final.value)
    missing = [o.replace("models:/smoke/1", "models:/smoke/7") for o in overrides]
    refused = _lmyard(env, "run", "smoke", *[a for o in missing for a in ("--set", o)], check=False)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("lmyard: error:")]
    assert "models:/smoke/7: no such registered model version" in line
    assert "train" not in [ln.split()[1].rstrip(":") for ln in refused.stdout.splitlines() if len(ln.split()) > 1]
