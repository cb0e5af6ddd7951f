"""A temporary Prefect server for `lmyard run` and `lmyard shard`, started so that an interrupt cannot orphan it or
stop it first.

With no PREFECT_API_URL, Prefect would start a temporary API server as a child process on the first client it
needs, in lmyard's process group: a terminal's Ctrl-C (SIGINT to the whole foreground group) would stop the server
at the same moment as the run, which then spends minutes retrying the API while it records how it ended, and exits
1 instead of 130. And only an atexit hook would stop it, so a SIGTERM or SIGKILL to lmyard would leave it running.

Design notes: docs/operations.md, `flows/prefect_server.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import IO

STARTUP_TIMEOUT_S = 90  # Prefect's default 20 s is short for a machine busy training
STOP_TIMEOUT_S = 10
# the server's own settings: what a run needs of it, no more
SERVER_ENV = {
    "PREFECT_SERVER_UI_ENABLED": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
}


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: SIGTERM to the server when the thread that started it (lmyard's main thread) ends
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: IO[bytes], timeout_s: float) -> None:
    """Poll the server's health endpoint until it answers; a RuntimeError with its output if it exits first or
    the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            tail = log.read()[-3000:].decode(errors="replace")
            why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"no answer in {timeout_s:g} s"
            raise RuntimeError(f"the temporary Prefect server at {url} did not start ({why}):\n{tail}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, log: IO[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


def start_temporary_server() -> str | None:
    """Start a temporary Prefect server, if this process would use one (no API URL set, Prefect's temporary server
    enabled), in a session of its own, and point PREFECT_API_URL at it; its API URL, or None."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = tempfile.TemporaryFile(prefix="lmyard-prefect-server-")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, **SERVER_ENV},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    atexit.register(_stop, proc, log)
    _wait_healthy(url, proc, log, STARTUP_TIMEOUT_S)
    os.environ["PREFECT_API_URL"] = url
    # no UI, and gone when the command ends: no "View at" link to a page that cannot open (an operator's own
    # PREFECT_UI_URL, or a persistent server through PREFECT_API_URL, keeps Prefect's link)
    os.environ.setdefault("PREFECT_UI_URL", "")
    refresh_global_settings_context()  # Prefect reads its settings from the environment once, at import
    return url
