"""Prefect's temporary server for `lmyard run` and `lmyard shard`, started so that an interrupt cannot orphan it or
stop it first.

With no PREFECT_API_URL, Prefect starts a temporary API server as a child process on the first client it needs.
As Prefect starts it, it shares lmyard's process group, so a terminal's Ctrl-C (SIGINT to the whole foreground
group) stops the server at the same moment as the run: the run then spends minutes retrying the API while it
records how it ended, and exits 1 instead of 130. And only an atexit hook stops it, so a SIGTERM or SIGKILL to
lmyard left it running.

Here lmyard starts that same server (Prefect's own class and command) before the flow, in a session of its own,
so only lmyard's signals reach it, and with PR_SET_PDEATHSIG, so the kernel stops it when lmyard dies however it
dies. Prefect's clients find it where they look for the temporary server (one instance per port, the default
one), and Prefect stops it at exit as it stops its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
from typing import Any

STARTUP_TIMEOUT_S = 90


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: SIGTERM to the server when the thread that started it (lmyard's main thread) ends
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class _OwnSession(subprocess.Popen):
    def __init__(self, *args: Any, **kwargs: Any):
        # Prefect's own arguments, passed on as they come (mypy cannot match them to one of Popen's overloads)
        super().__init__(*args, **kwargs, start_new_session=True, preexec_fn=_die_with_parent)  # type: ignore[call-overload]


def start_temporary_server() -> None:
    """Start Prefect's temporary server, if this process uses one (no API URL set), in a session of its own.

    Prefect's own atexit hook stops it, after its log and event workers have sent what they hold (stopping it
    earlier leaves them retrying a closed port for a minute); the kernel stops it if lmyard is killed."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    server = SubprocessASGIServer()  # the instance Prefect's clients use when no API URL is set
    # only for Prefect's one Popen call in start()
    popen, subprocess.Popen = subprocess.Popen, _OwnSession  # type: ignore[misc]
    try:
        # Prefect's default 20 s is short for a machine busy training; a server that is slow to start is no error
        server.start(timeout=max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), STARTUP_TIMEOUT_S))
    finally:
        subprocess.Popen = popen  # type: ignore[misc]
