"""A tracking server that is down: the run fails in seconds with one line; the trainer's metrics survive an
outage of the server; credentials in the tracking URI reach no param, tag or lineage.json."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from urllib.parse import urlparse

import pytest
from conftest import free_port, lmyard_cmd, tiny_overrides
from mlflow.tracking import MlflowClient
from tcp_proxy import TcpProxy

from lmyard.layout import RunLayout
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking.lineage import Lineage
from lmyard.tracking.sink import MLflowSink

pytestmark = pytest.mark.slow


@pytest.fixture
def mlflow_proxy(mlflow_server):
    """The session's MLflow server behind a TCP proxy that a test can cut (an outage) and restore."""
    proxy = TcpProxy(urlparse(mlflow_server.uri).port)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


def cut(proxy: TcpProxy) -> None:
    """Stop the proxy for good: closing its listener does not wake the thread blocked in accept(), which would
    let one more connection through; this connection is that one."""
    proxy.stop()
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", proxy.port), timeout=2):
        pass
    time.sleep(0.2)


@pytest.fixture
def quick_mlflow_retries(monkeypatch):
    # MLflow's client retries a refused connection for minutes by default; the sink's own retry is the next batch
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")


def test_metrics_logged_while_the_server_is_down_are_sent_after_it_returns(
    mlflow_server, mlflow_proxy, quick_mlflow_retries, capsys
):
    client = MlflowClient(mlflow_server.uri)
    run_id = client.create_run(client.create_experiment(f"sink-{time.time_ns()}")).info.run_id
    sink = MLflowSink(mlflow_proxy.url, run_id)
    sink.log({"loss/train": 1.0}, 1)
    sink.flush()
    cut(mlflow_proxy)
    try:
        for step in (2, 3, 4):
            sink.log({"loss/train": float(step)}, step)
            sink.flush(timeout=30)
    finally:
        mlflow_proxy.start()
    warned = [line for line in capsys.readouterr().out.splitlines() if "MLflow logging failed" in line]
    assert len(warned) == 1  # at once, once per kind of error
    sink.log({"loss/train": 5.0}, 5)
    sink.close()  # does not raise: the final flush succeeded
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss/train"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]


def test_a_hung_tracking_server_costs_the_checkpoints_one_flush_timeout_and_loses_no_point(mlflow_server, mlflow_proxy):
    client = MlflowClient(mlflow_server.uri)
    run_id = client.create_run(client.create_experiment(f"sink-{time.time_ns()}")).info.run_id
    sink = MLflowSink(mlflow_proxy.url, run_id)
    sink.log({"loss/train": 1.0}, 1)
    sink.flush()
    mlflow_proxy.hold()  # MLflow hangs: requests neither answer nor fail
    try:
        t0 = time.monotonic()
        for step in (2, 3, 4, 5):  # a checkpoint at each: the trainer flushes with a timeout first
            sink.log({"loss/train": float(step)}, step)
            sink.flush(timeout=3)
        elapsed = time.monotonic() - t0
    finally:
        mlflow_proxy.release()
    assert elapsed < 6, f"4 checkpoints waited {elapsed:.1f} s for a hung MLflow"  # one timeout, not four
    sink.log({"loss/train": 6.0}, 6)
    sink.close()  # the final flush keeps its guarantee
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss/train"))
    assert history == [(s, float(s)) for s in range(1, 7)]


def test_a_tracking_server_that_stops_answering_is_said_once_and_again_when_it_answers(
    mlflow_server, mlflow_proxy, monkeypatch, capsys
):
    """MLflow's client waits out an outage inside one call (its retries); the training thread says so after
    SLOW_S, once, and the sender says when the server answers again. No point is lost."""
    monkeypatch.setattr(MLflowSink, "SLOW_S", 2.0)
    client = MlflowClient(mlflow_server.uri)
    run_id = client.create_run(client.create_experiment(f"sink-{time.time_ns()}")).info.run_id
    sink = MLflowSink(mlflow_proxy.url, run_id)
    sink.log({"loss/train": 1.0}, 1)
    sink.flush()
    mlflow_proxy.hold()  # requests neither answer nor fail
    out, step = "", 2
    try:
        deadline = time.monotonic() + 60
        while "has not answered" not in out and time.monotonic() < deadline:
            sink.log({"loss/train": float(step)}, step)  # the training loop goes on logging
            step += 1
            time.sleep(0.5)
            out += capsys.readouterr().out
        for _ in range(4):  # more steps while it still hangs: nothing more is said
            sink.log({"loss/train": float(step)}, step)
            step += 1
            time.sleep(0.5)
    finally:
        mlflow_proxy.release()
    sink.close()
    out += capsys.readouterr().out
    assert out.count("the MLflow server has not answered") == 1, out
    assert out.count("the MLflow server answers again") == 1, out
    assert out.index("has not answered") < out.index("answers again")
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss/train"))
    assert history == [(s, float(s)) for s in range(1, step)]


def test_sink_that_cannot_send_at_close_warns_with_a_count_instead_of_failing(quick_mlflow_retries, capsys):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    sink = MLflowSink(uri, "0" * 32)
    for step in range(1, 4):
        sink.log({"loss/train": 1.0, "lr": 0.1}, step)
    sink.close()
    out = capsys.readouterr().out
    assert "6 metric points could not be sent to MLflow" in out


def test_credentials_in_the_tracking_uri_reach_no_param_tag_or_lineage_file(mlflow_server, tmp_path):
    secret_uri = mlflow_server.uri.replace("http://", "http://alice:s3cret@")
    cfg = load_recipe(
        "smoke",
        [f"store={tmp_path / 'store'}", f"tracking.uri={secret_uri}", f"tracking.experiment=creds-{time.time_ns()}"],
    )
    store = open_store(cfg.store)
    lineage = Lineage.open(cfg, Run(cfg.run_name, store), shard_address="abc", code_version="test")
    run = MlflowClient(mlflow_server.uri).get_run(lineage.ref.mlflow_run_id)
    assert run.data.params["tracking.uri"] == mlflow_server.uri.replace("http://", "http://alice:***@")
    saved = store.read_bytes(RunLayout(cfg.run_name).lineage).decode()
    assert json.loads(saved)["tracking_uri"] == run.data.params["tracking.uri"]
    everything = json.dumps([run.data.params, run.data.tags]) + saved
    assert "s3cret" not in everything


def test_unreachable_tracking_server_fails_the_run_in_seconds_with_one_line(cli_env, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    overrides = tiny_overrides(tmp_path, **{"tracking.uri": uri})
    t0 = time.monotonic()
    proc = subprocess.run(
        lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)]),
        cwd=tmp_path,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.monotonic() - t0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmyard: error:")]
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(errors) == 1 and uri in errors[0] and "tracking.uri" in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_tracking_password_moves_to_mlflows_environment_variables():
    from lmyard.tracking.credentials import credentials_to_env

    cfg = load_recipe("smoke", ["tracking.uri=https://alice:s%40cret@mlflow.example:8443/path"])
    environ: dict[str, str] = {}
    clean = credentials_to_env(cfg, environ)
    assert clean.tracking.uri == "https://mlflow.example:8443/path"
    assert environ == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "s@cret"}
    assert "tracking" in clean.model_fields_set and clean.model_dump(exclude={"tracking"}) == cfg.model_dump(
        exclude={"tracking"}
    )
    plain = load_recipe("smoke", ["tracking.uri=http://mlflow:5000"])
    assert credentials_to_env(plain, environ) is plain


def test_run_with_a_password_in_the_tracking_uri_writes_it_nowhere(cli_env, mlflow_server, tmp_path):
    from prefect.client.orchestration import get_client

    secret_uri = mlflow_server.uri.replace("http://", "http://alice:s3cret@")
    overrides = tiny_overrides(
        tmp_path, **{"tracking.uri": secret_uri, "tracking.experiment": f"secret-{time.time_ns()}", "eval.threads": 1}
    )
    proc = subprocess.run(
        lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)]),
        cwd=tmp_path,
        env={**cli_env, "PREFECT_LOGGING_LEVEL": "DEBUG"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "s3cret" not in proc.stdout + proc.stderr  # the log
    store = tmp_path / "store"
    states = list(store.rglob("state.json"))
    assert states and all(b"s3cret" not in p.read_bytes() for p in store.rglob("*") if p.is_file())
    run_id = json.loads((store / "runs/smoke/lineage.json").read_text())["mlflow_run_id"]
    client = MlflowClient(mlflow_server.uri)
    config_yaml = open(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read()
    assert f"uri: {mlflow_server.uri}" in config_yaml and "s3cret" not in config_yaml
    run = client.get_run(run_id)
    assert "s3cret" not in json.dumps([run.data.params, run.data.tags])
    with get_client(sync_client=True) as prefect:
        assert "s3cret" not in json.dumps([fr.parameters for fr in prefect.read_flow_runs()], default=str)
