"""One trial: an ordinary `lmyard run` of the trial's config in a process of its own (its lineage, checkpoints,
exact resume, retries of a crash: the pretrain flow's), watched for the val loss its lineage logs.

The sweep flow names the command (`python -m flows.cli run smoke --set ...`); this module starts it, reads the
points of `loss/val` from the lineage's MLflow run as they come, and on a stop sends SIGTERM (the flow checkpoints
and ends) and waits for it. The process gets SIGTERM too when the thread that started it dies (PR_SET_PDEATHSIG),
so a trial never outlives what watches it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from lmyard.errors import ExitCode, StageFailed
from lmyard.run import Run
from lmyard.tracking.lineage import Lineage

POLL_S = 2.0


class TrialFailed(StageFailed):
    """A trial's `lmyard run` ended with an error (after its own retries); `exit_code` is the run's when it was
    a user error (2: a config that cannot work), else a crash's (1)."""

    def __init__(self, message: str, code: int = ExitCode.CRASHED):
        super().__init__(message)
        self.exit_code = ExitCode.USER_ERROR if code == ExitCode.USER_ERROR else ExitCode.CRASHED

    def __reduce__(self):  # through Ray Tune's actors with its code
        return (TrialFailed, (str(self), int(self.exit_code)))


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the starting thread ends
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class TrialProcess:
    """`command` (a trial's `lmyard run`) running with its output in `log`; `points()` yields its val losses."""

    def __init__(self, trial: Run, command: list[str], log: Path, tracking_uri: str, env: dict[str, str]):
        self.trial, self.name, self.log, self.tracking_uri = trial, trial.name, log, tracking_uri
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, preexec_fn=_die_with_parent
            )
        self.seen: set[int] = set()

    def _new_points(self) -> list[tuple[int, float]]:
        lineage = Lineage.find(self.tracking_uri, self.trial)
        if lineage is None:
            return []
        history = lineage.metric_history("loss/val")
        new = sorted((s, v) for s, v in history.items() if s not in self.seen)
        self.seen.update(s for s, _ in new)
        return new

    def points(self) -> Iterator[tuple[int, float]]:
        """(step, val loss) as the lineage logs them, until the process ends; TrialFailed if it failed."""
        while self.proc.poll() is None:
            yield from self._new_points()
            time.sleep(POLL_S)
        yield from self._new_points()
        if self.proc.returncode != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise TrialFailed(
                f"trial {self.name} failed (exit {self.proc.returncode}): {tail[0]} (log: {self.log})",
                self.proc.returncode,
            )

    def stop(self, grace_s: float) -> None:
        """SIGTERM (the flow checkpoints and closes its lineage), then SIGKILL after `grace_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
