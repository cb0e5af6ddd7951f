"""When this attempt was launched: the start of the restart-to-first-step time (lmyard.train.components.Startup).

The launcher (lmyard.launch.local_job.LocalJob) sets LMYARD_LAUNCHED_AT, the wall-clock time (Unix seconds) it
started the stage's command, so the launch part covers torchrun's own start and the interpreter's imports. Without
it: torchrun's start when torchrun started this rank (its process is the parent), else this process's start.
Imports nothing heavy: the launcher, in the flow's process, reads the variable's name from here.
"""

from __future__ import annotations

import os

LAUNCHED_AT_ENV = "LMYARD_LAUNCHED_AT"
RANK_STARTED_ENV = "LMYARD_RANK_STARTED"  # a warm standby's rank: when torchrun started it (lmyard.launch.standby)
AGENT_STARTED_ENV = "LMYARD_AGENT_STARTED"  # a rank whose torchrun ran in a warm standby: when the launcher started it


def launched_at() -> tuple[float, str]:
    """(Unix seconds the launch began, what that time is: "launcher", "torchrun" or "process")."""
    value = os.environ.get(LAUNCHED_AT_ENV)
    if value:
        try:
            return float(value), "launcher"
        except ValueError:
            pass  # not a time: measured from the processes instead
    import psutil

    me = psutil.Process()
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's agent started this rank
        try:
            parent = me.parent()
            if parent is not None:
                return parent.create_time(), "torchrun"
        except psutil.Error:
            pass
    return me.create_time(), "process"
