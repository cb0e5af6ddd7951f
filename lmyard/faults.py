"""Fault injection for tests and failure drills.

    LMYARD_FAULTS="nan_loss@7,crash@12"

`nan_loss@S` makes the loss of step S non-finite; `crash@S` exits the trainer
process with status 1 right after step S (once earlier checkpoints are
committed); `crash_in_upload@S` exits while checkpoint S is half uploaded;
`slow_upload@S` delays the upload of checkpoint S by LMYARD_FAULT_SLOW_S seconds
(default 30: a slow store, for preemption drills); `hang@S` stops the last rank
after step S (a stuck collective, for the watchdog); `hang_before@S` stops the
last rank before step S (S=1: before its first step and heartbeat, as a rank
stuck in rendezvous or resume would, for the startup timeout); `pause@S` makes
every rank sleep LMYARD_FAULT_PAUSE_S seconds (default 5) after step S, a window
in which a drill acts at a known step; `kill@S` makes the last rank SIGKILL itself
after step S (the kernel's OOM killer, a `kill -9`); `pause_piece@N` makes
tokenize-and-shard's read piece N sleep LMYARD_FAULT_PAUSE_S seconds where it
runs as a Ray task (lmyard.data.raypool: a node lost mid-piece). Each fires
once per process, or once for good when LMYARD_FAULTS_STATE names a folder where fired faults are recorded (so
a retried job does not meet the same fault again).
Unset in production: nothing here fires.
"""

from __future__ import annotations

import os
import time

_fired: set[tuple[str, int]] = set()


def _planned() -> set[tuple[str, int]]:
    out = set()
    for item in filter(None, (x.strip() for x in os.environ.get("LMYARD_FAULTS", "").split(","))):
        kind, _, step = item.partition("@")
        out.add((kind, int(step)))
    return out


def fires(kind: str, step: int) -> bool:
    """True the first time `kind@step` is planned and reached in this process."""
    key = (kind, step)
    if key in _fired or key not in _planned():
        return False
    _fired.add(key)
    state = os.environ.get("LMYARD_FAULTS_STATE")
    if state:
        marker = os.path.join(state, f"{kind}@{step}")
        try:
            os.makedirs(state, exist_ok=True)
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # the first process to get here
            os.close(fd)
        except FileExistsError:
            return False
    return True


def delay(kind: str, step: int, env: str, default_s: float) -> bool:
    """Sleep `env` seconds (default `default_s`) the first time `kind@step` fires; whether it did."""
    if not fires(kind, step):
        return False
    time.sleep(float(os.environ.get(env, str(default_s))))
    return True
