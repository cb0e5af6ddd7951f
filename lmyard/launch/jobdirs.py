"""The exchange folders of local jobs under the cache root (LMYARD_CACHE): `lmyard-<stage>-XXXXXXXX/`.

A local job's folder holds its spec and what its processes write back (lmyard.stages: started, progress,
heartbeats, results). The job removes it when it ends, finished or failed (`LocalJob.close`). A launcher that
dies without closing (SIGKILL, the OOM killer, a lost Prefect worker) cannot: so each folder names its
launcher in `owner.json` (host, pid, start time since boot: a reused pid is another process), and every new
job first removes the folders whose launcher, on this host, no longer runs. Folders of live launchers, of
another host sharing the cache, or without an owner (being created, or not a job's) are left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile

import psutil

from lmyard.paths import cache_root, no_space

OWNER = "owner.json"


def new_job_folder(stage: str, root: str | None = None) -> str:
    """A fresh exchange folder for a job of `stage` under `root` (default the cache root), owned by this process;
    dead launchers' folders removed."""
    root = root or cache_root()
    os.makedirs(root, exist_ok=True)
    remove_orphans(root)
    folder = tempfile.mkdtemp(prefix=f"lmyard-{stage}-", dir=root)
    me = psutil.Process()
    owner = {"host": socket.gethostname(), "pid": me.pid, "started": me.create_time(), "since_boot": _since_boot(me)}
    try:
        with open(os.path.join(folder, OWNER), "w") as f:
            json.dump(owner, f)
    except OSError as e:  # a full cache disk: nothing of the job is left, and the one line names the cache
        shutil.rmtree(folder, ignore_errors=True)
        raise (no_space(e, root) or e) from None
    return folder


def remove_orphans(root: str) -> list[str]:
    """Remove the job folders under `root` whose launcher (on this host) has ended; the folders removed."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, OWNER)) as f:
                owner = json.load(f)
        except (OSError, ValueError):  # no owner (yet): not a job folder, or one being made
            continue
        if name.startswith("lmyard-") and owner.get("host") == socket.gethostname() and not _running(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _since_boot(p: psutil.Process) -> float:
    """When `p` started, in seconds since boot: unlike its start time in the epoch, this never moves when the
    wall clock steps or NTP slews the boot time that psutil adds (a whole second at a time)."""
    return p.create_time() - psutil.boot_time()


def _running(owner: dict) -> bool:
    try:
        p = psutil.Process(int(owner["pid"]))
        if "since_boot" in owner:
            return abs(_since_boot(p) - float(owner["since_boot"])) < 0.5
        return abs(p.create_time() - float(owner["started"])) < 1.0  # an older lmyard's folder
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, KeyError, TypeError, ValueError):  # not ours to judge: keep it
        return True
