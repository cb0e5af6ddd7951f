"""The watchdog that ends a job whose ranks stopped making progress.

`Watchdog.arm` at the job's start, `Watchdog.check(heartbeats)` about once a second from the launcher's
follow loop: a message naming the stalled ranks once no step changed for `launch.watchdog_s` (until every rank
says its loop has ended), or once a rank has not reported its first step within `launch.startup_timeout_s`.

Design notes: docs/launch.md, `lmyard/launch/watchdog.py`.
"""

from __future__ import annotations

import time

from lmyard.stages.heartbeat import FINISHED


class Watchdog:
    """The launcher's side: `check(beats)` returns a message once no step has completed for `timeout_s`, or
    once `startup_s` have passed since `arm()` and one of the `ranks` ranks has not completed its first step."""

    def __init__(self, timeout_s: float | None, clock=time.monotonic, *, startup_s: float | None = None, ranks=0):
        self.timeout_s, self.clock = timeout_s, clock
        self.startup_s, self.ranks = startup_s, ranks
        self.last: dict[str, str] = {}
        self.changed_at: float | None = None
        self.started_at, self.all_started = clock(), False

    def arm(self) -> None:
        """The job has started (its nodes are up): the startup clock starts now."""
        self.started_at = self.clock()

    def check(self, beats: dict[str, str]) -> str | None:
        return self._startup(beats) or self._stalled(beats)

    def _startup(self, beats: dict[str, str]) -> str | None:
        if not self.startup_s or not self.ranks or self.all_started:
            return None
        missing = [name for name in (f"rank-{r}" for r in range(self.ranks)) if name not in beats]
        # once every rank has reported, done for good: a later read that misses files (an engine blip) is no start
        self.all_started = not missing
        waited = self.clock() - self.started_at
        if not missing or waited <= self.startup_s:
            return None
        return (
            f"watchdog: {', '.join(missing)} completed no training step {waited:.0f}s after the start "
            f"(stuck in rendezvous, resume or step 1); launch.startup_timeout_s={self.startup_s:g}: "
            "raise it when loading or compiling takes longer"
        )

    def _stalled(self, beats: dict[str, str]) -> str | None:
        if not self.timeout_s or not beats or all(b.endswith(FINISHED) for b in beats.values()):
            return None  # every rank's loop has ended: its last upload and exit take what they take
        now = self.clock()
        if beats != self.last:
            self.last, self.changed_at = dict(beats), now
            return None
        assert self.changed_at is not None
        idle = now - self.changed_at
        if idle <= self.timeout_s:
            return None
        where = ", ".join(f"{name} after step {step or '?'}" for name, step in sorted(beats.items()))
        return (
            f"watchdog: no training step completed for {idle:.0f}s (launch.watchdog_s={self.timeout_s:g}); "
            f"last heartbeats: {where}"
        )
