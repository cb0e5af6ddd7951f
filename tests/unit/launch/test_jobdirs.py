"""Which job folders a new job removes: those of launchers that ended, never a live one's, whatever the clock does."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import psutil

from lmyard.launch.jobdirs import OWNER, new_job_folder, remove_orphans


def _procfs_with_boot_time_moved(tmp_path: Path, seconds: int) -> str:
    """A /proc whose `stat` says the machine booted `seconds` later, as after a wall-clock step or NTP's slew
    (the kernel derives btime from the wall clock); this process's own entry is the real one."""
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    stat = Path("/proc/stat").read_text()
    btime = int(re.search(r"^btime (\d+)$", stat, re.M).group(1))  # type: ignore[union-attr]
    (proc / "stat").write_text(stat.replace(f"btime {btime}\n", f"btime {btime + seconds}\n"))
    (proc / str(os.getpid())).symlink_to(f"/proc/{os.getpid()}")
    return str(proc)


def test_a_live_launchers_folder_stays_when_the_boot_time_moves(tmp_path, monkeypatch):
    root = str(tmp_path / "cache")
    mine = new_job_folder("shard", root)
    for moved in (1, 90):  # the one second of an NTP slew crossing a second; a step of a minute and a half
        monkeypatch.setattr(psutil, "PROCFS_PATH", _procfs_with_boot_time_moved(tmp_path / str(moved), moved))
        assert remove_orphans(root) == [] and os.path.isdir(mine)


def test_the_folders_of_launchers_that_ended_go_and_one_without_an_owner_stays(tmp_path):
    root = tmp_path / "cache"
    ended = subprocess.Popen(["true"])
    ended.wait()
    owners = {"lmyard-train-dead": ended.pid, "lmyard-train-reused": os.getpid()}  # a pid now another process's
    for name, pid in owners.items():
        (root / name).mkdir(parents=True)
        (root / name / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "since_boot": 1.0}))
    unowned = root / "lmyard-train-being-made"
    unowned.mkdir()
    assert remove_orphans(str(root)) == [str(root / name) for name in sorted(owners)]
    assert unowned.is_dir() and sorted(os.listdir(root)) == [unowned.name]
