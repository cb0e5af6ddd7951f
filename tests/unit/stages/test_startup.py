"""When a restart starts (lmyard.stages.startup.launched_at): the launcher's time, else this process's start (the
restart's parts in a real run: tests/integration/test_startup_integration.py)."""

from __future__ import annotations

import psutil

from lmyard.stages.startup import LAUNCHED_AT_ENV, launched_at


def test_launch_time_is_the_launchers_else_this_process_start(monkeypatch):
    monkeypatch.setenv(LAUNCHED_AT_ENV, "1234.5")
    assert launched_at() == (1234.5, "launcher")
    monkeypatch.delenv(LAUNCHED_AT_ENV)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launched_at() == (psutil.Process().create_time(), "process")
