"""Refusals in one line.

What the command line cannot do (a store or a destination this user cannot write) is one line,
`lmyard: error: ...`, exit 2, before the expensive part and without retries (a run that fails says its error
once: tests/integration/test_refusals_integration.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import REPO, lmyard_cmd

# Tests run as root, which writes anywhere: drop the capabilities that bypass file permissions.
UNPRIVILEGED = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def _unprivileged(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    return [*UNPRIVILEGED, *cmd]


def _assert_one_line_exit_2(proc: subprocess.CompletedProcess, *parts: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmyard: error:"), proc.stderr[-3000:]
    assert all(p in lines[0] for p in parts), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def _lmyard(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        _unprivileged(lmyard_cmd(*args)), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


# ---------------------------------------------------------------- folders this user cannot write


def test_store_below_a_folder_this_user_cannot_enter_names_that_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.chown(locked, 65534, 65534)  # another user's private folder
    store = locked / "sub" / "store"
    proc = _lmyard("shard", "smoke", "--set", f"store={store}")
    _assert_one_line_exit_2(proc, f"store {store} is not writable", f"this user cannot enter {locked}", "--set store=")


def test_store_whose_runs_folder_is_read_only_is_refused_before_training(tmp_path):
    store = tmp_path / "store"
    (store / "runs").mkdir(parents=True)
    (store / "runs").chmod(0o555)
    env = {**os.environ, "LMYARD_CACHE": str(tmp_path / "cache")}
    proc = _lmyard(
        "run", "smoke", "--set", f"store={store}", "--set", f"tracking.uri=sqlite:///{tmp_path}/m.db", env=env
    )
    _assert_one_line_exit_2(proc, f"store {store}: its folder {store / 'runs'} is not writable (Permission denied)")
    assert not (store / "shards").exists() and not (tmp_path / "m.db").exists()  # nothing sharded, nothing tracked


def test_export_to_a_folder_whose_parent_is_not_writable_is_one_line(tmp_path):
    from conftest import write_random_checkpoint

    uri, _ = write_random_checkpoint(tmp_path / "store")
    parent = tmp_path / "shelf"
    parent.mkdir(mode=0o555)
    env = {**os.environ, "LMYARD_CACHE": str(tmp_path / "cache")}
    proc = _lmyard("export", uri, "--to", str(parent / "hf"), env=env, timeout=300)
    _assert_one_line_exit_2(proc, f"destination {parent / 'hf'}: cannot write in {parent} (Permission denied)")
    assert list(parent.iterdir()) == []
