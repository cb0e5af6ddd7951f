"""The operator commands against real servers: `lmyard runs`, `lmyard status RUN`, `lmyard eval` and `lmyard sample`
on an S3 store with an MLflow tracking server, after a real run; `--json` for scripts, one line and exit 2 for a
lineage that is not there. eval and sample run in this process (flows.cli.main): a fresh interpreter's imports
would cost more than the evaluation."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import lmyard_cmd, tiny_overrides

from flows.cli import main
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking import lease

pytestmark = pytest.mark.slow


def _lmyard(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(lmyard_cmd(*args), env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


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
    held = lease.acquire(Run("busy", open_store(str(local))), {"flow_run": "nightly (1234)"}, ttl_s=300, wait_s=0)
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


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """One LMYARD_CACHE for the commands that read models: each downloads a checkpoint or an export once."""
    return str(tmp_path_factory.mktemp("model-cache"))


def _main(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _final_val_loss(tracking: str) -> tuple[str, float]:
    """The lineage smoke's MLflow run and the val loss its pipeline logged at the final step (6)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    (version,) = client.search_model_versions("name = 'smoke'")
    history = client.get_metric_history(version.run_id, "loss/eval")
    return version.run_id, next(m.value for m in history if m.step == 6)


def test_eval_of_a_lineage_gives_the_val_loss_its_run_logged_and_logs_it_to_that_run(
    finished_run, capsys, monkeypatch, model_cache
):
    from mlflow.tracking import MlflowClient

    _, store, tracking = finished_run
    monkeypatch.setenv("LMYARD_CACHE", model_cache)
    code, out, err = _main(capsys, "eval", "smoke", "--store", store, "--tracking-uri", tracking, "--json", "--log")
    assert code == 0, err
    result = json.loads(out)
    run_id, logged = _final_val_loss(tracking)
    assert result["step"] == 6 and result["model"] == f"{store}/runs/smoke/checkpoints/step_00000006"
    assert abs(result["val_loss"] - logged) < 1e-6 and result["metrics"] == {"loss/eval": result["val_loss"]}
    assert result["mlflow_run_id"] == run_id
    (again,) = MlflowClient(tracking).get_metric_history(run_id, "lmyard_eval/loss/eval")
    assert again.step == 6 and abs(again.value - result["val_loss"]) < 1e-9


def test_eval_and_sample_of_the_registered_version_match_its_checkpoint(finished_run, capsys, monkeypatch, model_cache):
    """models:/smoke/1 is the final checkpoint exported: the same val loss, the same sample for the same seed."""
    _, store, tracking = finished_run
    monkeypatch.setenv("LMYARD_CACHE", model_cache)
    where = ("--store", store, "--tracking-uri", tracking, "--json")
    code, out, err = _main(capsys, "eval", "models:/smoke/1", *where)
    assert code == 0, err
    result = json.loads(out)
    assert result["step"] == 6 and result["run_name"] == "smoke"
    assert abs(result["val_loss"] - _final_val_loss(tracking)[1]) < 1e-5
    prompt = ("--prompt", "The for statement", "--max-new-tokens", "12", "--seed", "3")
    samples = []
    for source in ("models:/smoke/1", "smoke"):
        code, out, err = _main(capsys, "sample", source, *prompt, *where)
        assert code == 0, err
        samples.append(json.loads(out))
    assert samples[0]["samples"] == samples[1]["samples"] and samples[0]["step"] == 6
    assert samples[0]["samples"][0]["prompt"] == "The for statement"
    code, text, _ = _main(capsys, "sample", "smoke", *prompt, *where[:-1])
    assert code == 0 and text == "The for statement" + samples[0]["samples"][0]["completion"] + "\n"


def test_eval_and_sample_mistakes_are_one_line_and_exit_2_before_a_model_is_read(
    finished_run, capsys, monkeypatch, tmp_path
):
    _, store, tracking = finished_run
    cache = tmp_path / "cache"
    monkeypatch.setenv("LMYARD_CACHE", str(cache))
    local = tmp_path / "store"
    held = lease.acquire(Run("empty", open_store(str(local))), {"flow_run": "starting"}, ttl_s=300, wait_s=0)
    try:
        cases = [
            (("eval", "nope", "--store", store), "no lineage 'nope'"),
            (("sample", "nope", "--prompt", "x", "--store", store), "lineages there: "),  # smoke, and others
            (("eval", "empty", "--store", str(local)), "run 'empty' has no complete checkpoint"),
            (("eval", "smoke", "--step", "4", "--store", store), "no complete checkpoint of step 4"),
            (("eval", "models:/smoke/9", "--tracking-uri", tracking), "models:/smoke/9: no such registered"),
            (("eval", "smoke", "--store", store, "--tasks", "hellaswag"), "give --hellaswag FILE"),
        ]
        for args, says in cases:
            code, out, err = _main(capsys, *args)
            assert code == 2 and out == "", (args, out, err)
            assert err.count("\n") == 1 and err.startswith("lmyard: error: ") and says in err, (args, err)
            assert "nope" not in args or "smoke" in err.split("lineages there: ")[-1], err
    finally:
        held.release()
    assert not (cache / "ondemand").exists()  # no checkpoint was downloaded, no model read
