"""One writer per lineage: the lease on runs/<run_name>/lease.json on S3 (moto server), two `lmyard run` of one
lineage at once, the fence that stops a holder which lost its lease, and corrupt lease and lineage files (on a
local store: tests/unit/tracking/test_lease.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import lmyard_cmd, tiny_overrides
from lease_helpers import *  # noqa: F403  the tests both tiers run, on this module's `store`

from lmyard.checkpoint.catalog import complete_steps, read_manifest
from lmyard.errors import ExitCode, UserError
from lmyard.layout import RunLayout
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking import lease


@pytest.fixture(params=["s3"])  # the S3 test server; on a local folder: tests/unit/tracking/test_lease.py
def store(request):
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/lmyard")


@pytest.mark.slow
def test_two_runs_of_one_lineage_one_refused_the_other_intact(cli_env, tmp_path):
    from mlflow.tracking import MlflowClient

    overrides = tiny_overrides(tmp_path, **{"tracking.lease_wait_s": 2})
    args = lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)])
    with open(tmp_path / "first.log", "w") as out:
        first = subprocess.Popen(args, cwd=tmp_path, env=cli_env, stdout=out, stderr=subprocess.STDOUT)
        try:
            lease_file = tmp_path / "store" / "runs" / "smoke" / "lease.json"
            deadline = time.monotonic() + 120
            while not lease_file.exists() and first.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert lease_file.exists(), (tmp_path / "first.log").read_text()[-3000:]
            holder = json.loads(lease_file.read_text())
            second = subprocess.run(args, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=180)
            assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            if first.poll() is None:
                first.kill()
    errors = [line for line in second.stderr.splitlines() if line.startswith("lmyard: error:")]
    assert second.returncode == 2 and len(errors) == 1, second.stdout[-2000:] + second.stderr[-2000:]
    assert "in use by another run" in errors[0] and f"pid {holder['pid']}" in errors[0]
    assert "Traceback" not in second.stdout + second.stderr
    assert not lease_file.exists()  # released at the end

    store = open_store(str(tmp_path / "store"))
    steps = complete_steps(Run("smoke", store))
    assert steps and steps[-1] == 6
    for step in steps:  # every checkpoint's files match its manifest
        manifest = read_manifest(Run("smoke", store), step)
        for name, meta in manifest.files.items():
            assert store.sha256(f"{RunLayout('smoke').step(step)}/{name}") == meta.sha256
    run_id = json.loads(store.read_bytes("runs/smoke/lineage.json"))["mlflow_run_id"]
    history = [
        m.step for m in MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run_id, "loss/train")
    ]
    assert sorted(history) == list(range(1, 7))


def test_s3_lease_errors_name_the_key_once(s3_server):
    bucket = "lmyard-no-such-bucket"
    store = open_store(f"s3://{bucket}/prefix")
    with pytest.raises(UserError) as e:
        lease.acquire(Run("r", store), {}, ttl_s=3, wait_s=0)
    assert f"s3://{bucket}/prefix/runs/r/lease.json" in str(e.value) and "prefix/prefix" not in str(e.value)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmyard: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return errors[0]


@pytest.mark.slow
def test_a_corrupt_lease_or_lineage_file_stops_the_run_in_one_line(cli_env, tmp_path):
    args = lmyard_cmd("run", "smoke", *[a for o in tiny_overrides(tmp_path) for a in ("--set", o)])
    run_dir = tmp_path / "store" / "runs" / "smoke"
    run_dir.mkdir(parents=True)
    (run_dir / "lease.json").write_text("{truncated")
    line = _one_error_line(subprocess.run(args, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300))
    assert "lease.json is corrupt" in line and "delete it" in line
    (run_dir / "lease.json").unlink()
    (run_dir / "lineage.json").write_text('{"experiment_id": "1"}')
    line = _one_error_line(subprocess.run(args, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300))
    assert "lineage.json is corrupt" in line and "delete it" in line
    assert not (run_dir / "lease.json").exists()  # the refused run gave its lease back


@pytest.mark.slow
def test_a_run_whose_flow_stalled_past_the_ttl_stops_and_nothing_is_written_twice(cli_env, tmp_path):
    """The drill: the first run's flow process is paused (SIGSTOP) past the ttl while its trainer runs on; a second
    run takes the lineage over. The first's trainer stops without committing, its flow registers nothing."""
    from mlflow.tracking import MlflowClient

    overrides = tiny_overrides(
        tmp_path,
        steps=9,
        **{"tracking.lease_ttl_s": 6, "tracking.lease_wait_s": 60, "launch.nproc_per_node": 1},
    )
    args = lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)])
    store, log = open_store(str(tmp_path / "store")), tmp_path / "first.log"
    # the first trainer sleeps 20 s after step 4: it is still running when the second run takes over
    first_env = {**cli_env, "LMYARD_FAULTS": "pause@4", "LMYARD_FAULT_PAUSE_S": "20"}
    first = subprocess.Popen(args, cwd=tmp_path, env=first_env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while 3 not in complete_steps(Run("smoke", store)):
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGSTOP)  # the flow stalls: no heartbeat; its trainer runs on
        second_env = {**cli_env, "LMYARD_CACHE": str(tmp_path / "cache2")}
        second = subprocess.run(args, cwd=tmp_path, env=second_env, capture_output=True, text=True, timeout=300)
        os.kill(first.pid, signal.SIGCONT)
        first_code = first.wait(timeout=180)
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
    first_out = log.read_text()
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert first_code == ExitCode.LEASE_LOST, first_out[-3000:]
    assert "lease lost to" in first_out and "stopped without writing further" in first_out
    assert not [line for line in first_out.splitlines() if line.startswith("Traceback")]  # the flow's: none
    assert first_out.splitlines()[-1].startswith("lmyard: error: lineage smoke: lease lost to")

    assert complete_steps(Run("smoke", store)) == [3, 6, 9]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads(store.read_bytes("runs/smoke/lineage.json"))["mlflow_run_id"]
    keys = list(client.get_run(run_id).data.metrics)
    for key in [k for k in keys if k.startswith(("checkpoint/", "loss/train"))]:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))  # no step logged twice
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss/train")) == list(range(1, 10))
    versions = client.search_model_versions()
    assert len(versions) == 1, [(v.name, v.version, v.tags) for v in versions]  # only the second registered
