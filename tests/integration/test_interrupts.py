"""`lmyard run` interrupted from a terminal: Ctrl-C (SIGINT to the whole foreground process group) and SIGTERM.

Each interrupt comes at a step that is not a checkpoint step (checkpoints every 1,000 steps, the signal after
step 10): the trainer checkpoints the step it stopped at, the flow keeps the lineage's lease until that commit is
done, and a rerun of the same command resumes from that step.

The runs use Prefect's temporary server, as a person's terminal does (no PREFECT_API_URL). Bounds are derived
from `launch.grace_s` and polled, never a fixed hair trigger: a loaded machine may take its time within them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import lmyard_cmd, tiny_overrides
from mlflow.tracking import MlflowClient

from lmyard.checkpoint.catalog import complete_steps
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow
GRACE_S = 60
# after the trainer's grace, the flow records the end (MLflow, Prefect) and Python exits: generous on a busy machine
RECORD_S = 90


INTERVAL = 1000  # no regular checkpoint before the interrupt: what is committed is the preemption's


def _overrides(tmp_path: Path, steps: int) -> list[str]:
    return tiny_overrides(
        tmp_path,
        steps=steps,
        **{
            "checkpoint.interval": INTERVAL,
            "launch.nproc_per_node": 1,
            "launch.grace_s": GRACE_S,
            "train.threads_per_rank": 1,
            "tracking.system_metrics": False,
            "tracking.registry": False,  # the interrupt and the resume are the point: no export, no registered model
        },
    )


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), LMYARD_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    return env


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "out.log"
    # A terminal's foreground job takes Ctrl-C even where the tests were started in the background, which ignores
    # SIGINT and passes that on: with a handler here, the run starts with SIGINT's default instead.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            lmyard_cmd("run", "smoke", *[a for o in _overrides(tmp_path, 2000) for a in ("--set", o)]),
            cwd=tmp_path,
            env=_env(tmp_path),
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job has
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    return proc, log


def _signal_after_step_10(proc: subprocess.Popen, log: Path, send) -> list[psutil.Process]:
    """Wait until the trainer is past step 10, note every process of the run (the temporary server, torchrun, its
    ranks), signal; returns those processes."""
    deadline = time.monotonic() + 300
    try:
        while not re.search(r"step (1\d|[2-9]\d|\d{3,})/2000", log.read_text()):
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


def _the_stopped_step_is_committed_and_a_rerun_resumes_from_it(tmp_path: Path, store) -> None:
    """The interrupted step (not a checkpoint step) holds a complete checkpoint, and the same command, run again
    (to two steps past it), resumes from it as the lineage's next attempt."""
    steps = complete_steps(Run("smoke", store))
    assert len(steps) == 1 and 10 < steps[0] < INTERVAL, steps  # the preemption checkpoint, committed
    stopped = steps[0]
    rerun = subprocess.run(
        lmyard_cmd("run", "smoke", *[a for o in _overrides(tmp_path, stopped + 2) for a in ("--set", o)]),
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert re.search(rf"resumed from \S*step_{stopped:08d} at step {stopped}\b", rerun.stdout + rerun.stderr), (
        rerun.stdout[-3000:]
    )


def test_ctrl_c_commits_the_step_it_stopped_at_exits_130_leaves_no_process_and_the_rerun_resumes_there(tmp_path):
    proc, log = _start(tmp_path)
    store = open_store(str(tmp_path / "store"))
    family = _signal_after_step_10(proc, log, lambda: os.killpg(proc.pid, signal.SIGINT))
    _wait_exit(proc, log, GRACE_S + RECORD_S)
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert "lease lost" not in log.read_text()
    assert not _left(family)
    run_id = json.loads(store.read_bytes("runs/smoke/lineage.json"))["mlflow_run_id"]
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "KILLED"
    # the trainer was stopped with the flow, not left running (nor retried): no checkpoint appears afterwards
    after_exit = complete_steps(Run("smoke", store))
    time.sleep(3)
    assert complete_steps(Run("smoke", store)) == after_exit
    _the_stopped_step_is_committed_and_a_rerun_resumes_from_it(tmp_path, store)


def test_sigterm_to_lmyard_run_commits_the_step_it_stopped_at_exits_143_orphans_no_server_and_the_rerun_resumes(
    tmp_path,
):
    proc, log = _start(tmp_path)
    store = open_store(str(tmp_path / "store"))
    family = _signal_after_step_10(proc, log, lambda: os.kill(proc.pid, signal.SIGTERM))
    _wait_exit(proc, log, GRACE_S + RECORD_S)
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert "lease lost" not in log.read_text()
    assert not _left(family)
    run_id = json.loads(store.read_bytes("runs/smoke/lineage.json"))["mlflow_run_id"]
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "KILLED"
    _the_stopped_step_is_committed_and_a_rerun_resumes_from_it(tmp_path, store)
