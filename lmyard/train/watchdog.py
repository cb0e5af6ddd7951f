"""Step heartbeats, and the watchdog that ends a job whose ranks stopped making progress.

Every rank writes its step number to `<exchange>/heartbeat/rank-<R>` when it
completes a step (the exchange folder comes from LMYARD_EXCHANGE_DIR, set by the
launcher). The launcher's follow loop (lmyard.launch, shared by every backend)
reads the heartbeats about once a second -- from the local folder, or from each
container through its engine -- and hands them to `Watchdog.check`. When no
rank's step has changed for `timeout_s` (a hung NCCL collective, a dead data
source, a stuck filesystem) the check returns a message that says which ranks
stopped where, and the launcher kills the job, so the task fails and a retry
resumes from the last checkpoint. The clock is the launcher's own (no clock is
compared across hosts), and it starts at the first heartbeat: loading,
compiling and the first step are not timed.
"""

from __future__ import annotations

import os
import time

from lmyard.contracts import Exchange


class Heartbeat:
    """The trainer's side: one file per rank holding the last completed step."""

    def __init__(self, rank: int):
        exchange = Exchange.from_env()
        self.path = None
        if exchange is not None:
            os.makedirs(exchange.heartbeats, exist_ok=True)
            self.path = os.path.join(exchange.heartbeats, f"rank-{rank}")

    def beat(self, step: int) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, self.path)


def read_beats(folder: str) -> dict[str, str]:
    """rank name -> last step, from a local heartbeat folder."""
    out: dict[str, str] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".tmp") or name.startswith("."):  # files being written
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                out[name] = f.read().strip()
        except OSError:
            continue
    return out


class Watchdog:
    """The launcher's side: `check(beats)` returns a message once no step has completed for `timeout_s`."""

    def __init__(self, timeout_s: float | None, clock=time.monotonic):
        self.timeout_s, self.clock = timeout_s, clock
        self.last: dict[str, str] = {}
        self.changed_at: float | None = None

    def check(self, beats: dict[str, str]) -> str | None:
        if not self.timeout_s or not beats:
            return None
        now = self.clock()
        if beats != self.last:
            self.last, self.changed_at = dict(beats), now
            return None
        idle = now - self.changed_at
        if idle <= self.timeout_s:
            return None
        where = ", ".join(f"{name} after step {step or '?'}" for name, step in sorted(beats.items()))
        return (
            f"watchdog: no training step completed for {idle:.0f}s (launch.watchdog_s={self.timeout_s:g}); "
            f"last heartbeats: {where}"
        )
