"""One writer per lineage: the lease on runs/<run_name>/lease.json, on a local store and on S3 (moto server),
and two `lmyard run` of one lineage at once."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import pytest
from conftest import lmyard_cmd, tiny_overrides

from lmyard.checkpoint.catalog import complete_steps, read_manifest, step_prefix
from lmyard.errors import UserError
from lmyard.layout import RunLayout
from lmyard.store import open_store
from lmyard.tracking import lease


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/lmyard")


def test_second_acquirer_refuses_naming_the_holder(store):
    first = lease.acquire(store, "r", {"flow_run": "first-run"}, ttl_s=30, wait_s=0)
    try:
        with pytest.raises(UserError) as e:
            lease.acquire(store, "r", {"flow_run": "second-run"}, ttl_s=30, wait_s=0.5)
        msg = str(e.value)
        assert "in use by another run" in msg and "first-run" in msg and socket.gethostname() in msg
        assert f"since {first.record['since']}" in msg and "\n" not in msg
    finally:
        first.release()
    assert not store.exists(RunLayout("r").lease)
    lease.acquire(store, "r", {"flow_run": "third-run"}, ttl_s=30, wait_s=0).release()


def test_concurrent_acquirers_one_wins_the_other_waits_for_the_release(store):
    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def take(name: str) -> None:
        start.wait()
        try:
            held = lease.acquire(store, "r", {"flow_run": name}, ttl_s=30, wait_s=20, poll_s=0.2)
        except UserError as e:
            results[name] = e
            return
        results[name] = time.monotonic()
        time.sleep(1.5)
        held.release()
        results[f"{name}-released"] = time.monotonic()

    threads = [threading.Thread(target=take, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results["a"], float) and isinstance(results["b"], float)
    first, second = sorted(("a", "b"), key=lambda n: results[n])
    assert results[second] >= results[f"{first}-released"]  # never both at once


def test_an_expired_lease_is_taken_over_and_a_live_one_is_renewed(store):
    key = RunLayout("r").lease
    stale = {
        "host": "gone-host",
        "pid": 1,
        "flow_run": "crashed-run",
        "token": "t",
        "since": "2026-01-01T00:00:00Z",
        "ttl_s": 5,
        "heartbeat": time.time() - 60,
    }
    store.write_bytes(key, json.dumps(stale).encode())
    held = lease.acquire(store, "r", {"flow_run": "new-run"}, ttl_s=3, wait_s=0)
    try:
        first = json.loads(store.read_bytes(key))
        assert first["flow_run"] == "new-run"
        time.sleep(2.5)  # the heartbeat renews every ttl/3 = 1 s
        assert json.loads(store.read_bytes(key))["heartbeat"] > first["heartbeat"]
        with pytest.raises(UserError, match="new-run"):
            lease.acquire(store, "r", {"flow_run": "other"}, ttl_s=3, wait_s=0)
    finally:
        held.release()


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
    steps = complete_steps(store, "smoke")
    assert steps and steps[-1] == 6
    for step in steps:  # every checkpoint's files match its manifest
        manifest = read_manifest(store, "smoke", step)
        for name, meta in manifest.files.items():
            assert store.sha256(f"{step_prefix('smoke', step)}/{name}") == meta.sha256
    run_id = json.loads(store.read_bytes("runs/smoke/lineage.json"))["mlflow_run_id"]
    history = [
        m.step for m in MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run_id, "train/loss")
    ]
    assert sorted(history) == list(range(1, 7))
