"""The ways a stage can end, each with its exit code and whether a retry can help.

    0 done   1 crashed (retried)   2 user_error (never retried)   3 diverged (never retried)
    4 store_outage (retried) or no_space (not retried)   5 preempted (retried)   6 lease_lost (never retried)

A failing stage writes its result file with its status and exits with the status's code; the launcher reads
the file (never the log) and raises the matching exception; `retryable()` decides the train task's retry.

Design notes: docs/launch.md, `lmyard/errors.py`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

Status = Literal["done", "crashed", "user_error", "diverged", "store_outage", "preempted", "no_space", "lease_lost"]


class ExitCode(IntEnum):
    DONE = 0
    CRASHED = 1
    USER_ERROR = 2
    DIVERGED = 3
    STORE_OUTAGE = 4
    PREEMPTED = 5
    LEASE_LOST = 6


class UserError(ValueError):
    """Bad input: a recipe, a config value, a data source, a tokenizer, a size that does not fit."""

    exit_code = ExitCode.USER_ERROR


class StageFailed(RuntimeError):
    """A stage ended without its result; the base of the failures below."""

    exit_code = ExitCode.CRASHED


class TrainingFailed(StageFailed):
    """The training job crashed, lost a node or stalled: the message is one line (which rank failed first, and
    why); `output` holds at most 10 lines of that rank's own output (lmyard.launch.cause)."""

    def __init__(self, message: str = "", output: list[str] | None = None):
        super().__init__(message)
        self.output = list(output or [])


class Diverged(StageFailed):
    """The loss became non-finite or spiked, and the guard's policy stops the run."""

    exit_code = ExitCode.DIVERGED


class StoreOutage(StageFailed):
    """Checkpoints could not reach the store within the allowed time; they stay staged locally."""

    exit_code = ExitCode.STORE_OUTAGE


class NoSpace(StageFailed):
    """The local cache disk (LMYARD_CACHE: staging, heartbeats, exchange, shard cache) is full or over quota
    (ENOSPC, EDQUOT). Exit code 4 like a store outage (the checkpoints could not be written), but not retried:
    a retry would run into the same full disk (lmyard.paths.no_space makes it from an OSError)."""

    exit_code = ExitCode.STORE_OUTAGE


class StoreFull(NoSpace):
    """The disk of a local store is full or over quota: the checkpoints that could not be uploaded stay staged in
    LMYARD_CACHE (not deleted), and a rerun once space is freed uploads them (lmyard.checkpoint.commit)."""


class Preempted(StageFailed):
    """The stage was asked to stop (SIGTERM) and saved a checkpoint first; a rerun resumes from it."""

    exit_code = ExitCode.PREEMPTED


class LeaseLost(StageFailed):
    """The lineage's lease is no longer this run's (taken over, or its heartbeat too old to keep): it stops
    writing (no checkpoint, no metric) and ends; the lineage's new holder carries on."""

    exit_code = ExitCode.LEASE_LOST


_BY_CODE: dict[int, type[Exception]] = {
    e.exit_code: e for e in (UserError, Diverged, StoreOutage, Preempted, LeaseLost, TrainingFailed)
}
STATUS: dict[ExitCode, Status] = {
    ExitCode.DONE: "done",
    ExitCode.CRASHED: "crashed",
    ExitCode.USER_ERROR: "user_error",
    ExitCode.DIVERGED: "diverged",
    ExitCode.STORE_OUTAGE: "store_outage",
    ExitCode.PREEMPTED: "preempted",
    ExitCode.LEASE_LOST: "lease_lost",
}


def error_for(code: int, message: str, status: str | None = None) -> Exception:
    """The exception a launcher raises for a stage that exited with `code` (and wrote `status`: two ends share
    code 4, see NoSpace)."""
    if status == "no_space":
        return NoSpace(message)
    return _BY_CODE.get(code, TrainingFailed)(message)


def status_of(exc: BaseException) -> Status:
    """The status a stage's result file records for `exc` (its exit code's, or the error's own)."""
    return "no_space" if isinstance(exc, NoSpace) else STATUS[exit_code_of(exc)]


def exit_code_of(exc: BaseException) -> ExitCode:
    """The exit code a stage ends with when `exc` stops it (an interrupt: preempted)."""
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.PREEMPTED
    return ExitCode(getattr(exc, "exit_code", ExitCode.CRASHED))


def retryable(exc: BaseException | None) -> bool:
    """Whether rerunning can help: not for bad input, divergence (the guard already had its say), a lost lease
    (another run writes the lineage now) or a full cache disk (the retry would fill it again)."""
    return not isinstance(exc, (UserError, Diverged, LeaseLost, NoSpace))


def one_line(exc: BaseException) -> str:
    """An exception as the one line a person reads: its message's first line, else its type's name."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
