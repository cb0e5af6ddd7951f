"""When a restart starts (lmyard.stages.startup.launched_at): the launcher's time, else this process's start (the
restart's parts in a real run: tests/integration/test_startup_integration.py)."""

from __future__ import annotations

import os

import psutil
import torch

from lmyard.stages.startup import LAUNCHED_AT_ENV, launched_at
from lmyard.train.components import missing_bytecode


def test_launch_time_is_the_launchers_else_this_process_start(monkeypatch):
    monkeypatch.setenv(LAUNCHED_AT_ENV, "1234.5")
    assert launched_at() == (1234.5, "launcher")
    monkeypatch.delenv(LAUNCHED_AT_ENV)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launched_at() == (psutil.Process().create_time(), "process")


def test_a_torch_without_bytecode_is_named_with_the_command_that_compiles_it(monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "__cached__", str(tmp_path / "__init__.cpython-312.pyc"))  # none beside the sources
    line = missing_bytecode()
    site = os.path.dirname(os.path.dirname(torch.__file__))
    assert line is not None and f"python -m compileall -q -j 0 {site}" in line
    (tmp_path / "__init__.cpython-312.pyc").write_bytes(b"")
    assert missing_bytecode() is None
