"""Step heartbeats and the watchdog that kills a job whose ranks stopped making progress.

Every rank touches `<dir>/rank-<R>` when it completes a step (the directory
comes from LMYARD_HEARTBEAT_DIR, set by the launcher). The launcher's watchdog
thread looks at the files every second: when no rank has completed a step for
`timeout_s` (a hung NCCL collective, a dead data source, a stuck filesystem),
it calls `on_stall` with a message that says which ranks stopped where, and the
launcher kills the job, so the task fails and a retry resumes from the last
checkpoint. The clock starts at the first heartbeat: loading, compiling and
the first step are not timed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

ENV = "LMYARD_HEARTBEAT_DIR"


class Heartbeat:
    """The trainer's side: one file per rank, its mtime the time of the last completed step."""

    def __init__(self, rank: int):
        folder = os.environ.get(ENV)
        self.path = os.path.join(folder, f"rank-{rank}") if folder else None

    def beat(self, step: int) -> None:
        if self.path:
            with open(self.path, "w") as f:
                f.write(str(step))


class Watchdog:
    """The launcher's side: a thread that calls `on_stall(message)` once when heartbeats stop."""

    def __init__(self, folder: str, timeout_s: float, on_stall: Callable[[str], None], poll_s: float = 1.0):
        self.folder, self.timeout_s, self.on_stall, self.poll_s = folder, timeout_s, on_stall, poll_s
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="watchdog")

    def __enter__(self) -> Watchdog:
        os.makedirs(self.folder, exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join()

    def _beats(self) -> dict[str, tuple[float, str]]:
        out = {}
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            try:
                with open(path) as f:
                    out[name] = (os.path.getmtime(path), f.read().strip())
            except OSError:
                continue
        return out

    def _watch(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            beats = self._beats()
            if not beats:
                continue
            newest = max(t for t, _ in beats.values())
            idle = time.time() - newest
            if idle > self.timeout_s:
                where = ", ".join(f"{name} after step {step or '?'}" for name, (_, step) in sorted(beats.items()))
                self.on_stall(f"watchdog: no training step completed for {idle:.0f}s "
                              f"(launch.watchdog_s={self.timeout_s:g}); last heartbeats: {where}")
                return
