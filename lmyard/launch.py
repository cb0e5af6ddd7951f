"""Launchers: start torchrun on every node and follow it.

`LocalLauncher` runs torchrun as a subprocess of this machine (one node, or
one node of several with `launch.rdzv_endpoint`), streams every output line
to a callback (the Prefect log, in the flow) and fails loudly with the tail
of the output when a rank fails. The child dies with its parent: it is in its
own process group, which is killed when the launcher is interrupted, and it
gets SIGTERM if the launching process dies.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable

from lmyard import watchdog
from lmyard.config import RunConfig
from lmyard.errors import UserError


class TrainingFailed(RuntimeError):
    """The training job exited non-zero; the message holds the tail of its output."""


def torchrun_args(cfg: RunConfig) -> list[str]:
    args = ["--nnodes", str(cfg.launch.nnodes), "--nproc_per_node", str(cfg.launch.nproc_per_node)]
    if cfg.launch.nnodes == 1:
        return ["--standalone", *args]
    if not cfg.launch.rdzv_endpoint:
        raise UserError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of node 0)")
    return [*args, "--rdzv_backend", "c10d", "--rdzv_endpoint", cfg.launch.rdzv_endpoint,
            "--rdzv_id", cfg.run_name]


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: the kernel sends SIGTERM to torchrun if the launching process dies,
    # and torchrun then stops its workers.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def run_local(cfg: RunConfig, spec: dict, on_line: Callable[[str], None] = print, tail_lines: int = 40) -> dict:
    """Run the trainer with torchrun here; returns the result line rank 0 prints."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="lmyard-spec-", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg), "-m", "lmyard.train", "--spec", spec_path]
    heartbeats = tempfile.mkdtemp(prefix="lmyard-heartbeat-")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", watchdog.ENV: heartbeats}
    stalled: list[str] = []
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    result: dict | None = None
    user_error: str | None = None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                            start_new_session=True, preexec_fn=_die_with_parent)
    def on_stall(message: str) -> None:
        stalled.append(message)
        on_line(message + "; stopping the job")
        _kill_group(proc)

    dog = watchdog.Watchdog(heartbeats, cfg.launch.watchdog_s, on_stall) if cfg.launch.watchdog_s else None
    try:
        if dog:
            dog.__enter__()
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            if line.startswith("result "):
                result = json.loads(line.removeprefix("result "))
            else:
                if user_error is None and "lmyard: error:" in line:
                    user_error = line.split("lmyard: error:", 1)[1].strip()
                on_line(line)
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if dog:
            dog.__exit__(None, None, None)
        os.unlink(spec_path)
        shutil.rmtree(heartbeats, ignore_errors=True)
    if stalled:
        raise TrainingFailed(stalled[0] + "; a retry resumes from the last checkpoint")
    if rc != 0:
        if user_error:
            raise UserError(user_error)
        raise TrainingFailed(f"training exited with code {rc}; last lines:\n" + "\n".join(tail))
    if result is None:
        raise TrainingFailed("training exited without a result line; last lines:\n" + "\n".join(tail))
    return result


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
