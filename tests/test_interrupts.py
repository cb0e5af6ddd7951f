"""`lmyard run` interrupted from a terminal: Ctrl-C (SIGINT to the whole foreground process group) and SIGTERM.

The runs use Prefect's temporary server, as a person's terminal does (no PREFECT_API_URL). Bounds are derived
from `launch.grace_s` and polled, never a fixed hair trigger: a loaded machine may take its time within them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import lmyard_cmd, tiny_overrides
from mlflow.tracking import MlflowClient

from lmyard.checkpoint.catalog import complete_steps
from lmyard.store import open_store

pytestmark = pytest.mark.slow
GRACE_S = 60
# after the trainer's grace, the flow records the end (MLflow, Prefect) and Python exits: generous on a busy machine
RECORD_S = 90


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    overrides = tiny_overrides(
        tmp_path,
        steps=2000,
        **{
            "checkpoint.interval": 5,
            "launch.nproc_per_node": 1,
            "launch.grace_s": GRACE_S,
            "train.threads_per_rank": 1,
            "tracking.system_metrics": False,
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), LMYARD_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    log = tmp_path / "out.log"
    # A terminal's foreground job takes Ctrl-C even where the tests were started in the background, which ignores
    # SIGINT and passes that on: with a handler here, the run starts with SIGINT's default instead.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)]),
            cwd=tmp_path,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job has
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    return proc, log


def _signal_after_first_checkpoint(proc: subprocess.Popen, log: Path, store, send) -> list[psutil.Process]:
    """Wait for the first checkpoint, note every process of the run (the temporary server, torchrun, its ranks),
    signal; returns those processes."""
    deadline = time.monotonic() + 300
    try:
        while not complete_steps(store, "smoke"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        family = psutil.Process(proc.pid).children(recursive=True)
        servers = [p for p in family if "prefect server start" in " ".join(p.cmdline())]
        assert servers, "no temporary Prefect server among the run's processes"
        assert all(os.getsid(p.pid) == p.pid for p in servers), "the temporary server shares the run's session"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the run, not left behind by a failed test
        raise
    send()
    return family


def _wait_exit(proc: subprocess.Popen, log: Path, limit_s: float) -> float:
    """Seconds until the run exits, polled; fails with its last lines past limit_s."""
    start = time.monotonic()
    try:
        while proc.poll() is None:
            assert time.monotonic() - start < limit_s, (
                f"still running {limit_s:g} s after the signal:\n" + (log.read_text()[-3000:])
            )
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return time.monotonic() - start


def _left(family: list[psutil.Process]) -> list[str]:
    time.sleep(2)  # the kernel's parent-death signal is delivered as the run exits
    return [" ".join(p.cmdline()[:4]) for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_ctrl_c_ends_the_run_killed_with_exit_130_within_its_grace_and_leaves_no_process(tmp_path):
    proc, log = _start(tmp_path)
    store = open_store(str(tmp_path / "store"))
    family = _signal_after_first_checkpoint(proc, log, store, lambda: os.killpg(proc.pid, signal.SIGINT))
    _wait_exit(proc, log, GRACE_S + RECORD_S)
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert not _left(family)
    run_id = json.loads(store.read_bytes("runs/smoke/lineage.json"))["mlflow_run_id"]
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "KILLED"
    # the trainer was stopped with the flow, not left running: no checkpoint appears afterwards
    after_exit = complete_steps(store, "smoke")
    time.sleep(3)
    assert complete_steps(store, "smoke") == after_exit and after_exit[-1] < 2000


def test_sigterm_to_lmyard_run_ends_it_killed_and_orphans_no_server(tmp_path):
    proc, log = _start(tmp_path)
    store = open_store(str(tmp_path / "store"))
    family = _signal_after_first_checkpoint(proc, log, store, lambda: os.kill(proc.pid, signal.SIGTERM))
    _wait_exit(proc, log, GRACE_S + RECORD_S)
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), log.read_text()[-3000:]
    assert not _left(family)
    run_id = json.loads(store.read_bytes("runs/smoke/lineage.json"))["mlflow_run_id"]
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "KILLED"
