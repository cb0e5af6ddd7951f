"""The one way a stage process ends, and the one way back: its exit code and result file.

`run_stage` turns a stage's result or exception into its exit code (lmyard.errors.ExitCode) and result file
(the result, or a StageError); the trainer's ranks use it too. `read_result` is how the launcher reads that
file back; `read_spec` how a stage reads its spec. `rank_exit` is the exit code a training rank's process ends
with, and `rank_exits` how lmyard's torchrun (lmyard.launch.torchrun) reads back the codes of the preempted ranks
that exited 0. `exit_fast` is how a stage process, torchrun's agent and a warm standby end.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from pydantic import BaseModel

from lmyard.errors import ExitCode, NoSpace, UserError, exit_code_of, one_line, status_of
from lmyard.paths import no_space
from lmyard.stages.exchange import SPEC_ENV, Contract, M, write_json
from lmyard.stages.results import StageError

OUTPUT_LINES = 10  # of a failed rank's traceback, in its failure record: what the launcher shows of it

# set by lmyard's torchrun (lmyard.launch.torchrun) to a folder of its own, which its ranks inherit
RANK_EXITS_ENV = "LMYARD_RANK_EXITS"


def read_spec(cls: type[M], path: str | None) -> M:
    """A stage's spec: the file `path`, else the LMYARD_SPEC environment variable (a container's)."""
    if path:
        with open(path) as f:
            return cls.model_validate_json(f.read())
    if SPEC_ENV in os.environ:
        return cls.model_validate_json(os.environ[SPEC_ENV])
    raise UserError(f"no spec: give --spec PATH or set {SPEC_ENV} (the {cls.__name__} as JSON)")


def run_stage(
    produce: Callable[[], BaseModel],
    out: str | None,
    *,
    failure_out: str | None = None,
    failed: Callable[[ExitCode, str], BaseModel] = StageError.ended,
    quiet: bool = False,
    rank: int | None = None,
) -> int:
    """The one way a stage process ends: `produce()`'s result goes to `out`, or its failure (`failed(code,
    message)`, a StageError unless the stage says otherwise) to `failure_out` (default: `out`); returns the exit
    code (lmyard.errors.ExitCode). An unexpected error prints its traceback, a known one a single line (`quiet`:
    none, e.g. on every rank but 0, which all fail alike).

    A training rank (`rank`) prints no traceback: its failure record carries the rank, the time and the
    traceback's last lines, and the launcher says the failure once, from the rank that failed first (the others'
    errors are about their peer's absence: a traceback of each would bury the cause)."""
    import sys
    import traceback

    try:
        result = produce()
    except BaseException as e:  # KeyboardInterrupt included: SIGINT ends a stage as preempted
        at = time.time()
        error = no_space(e) or e  # a full cache disk, wherever it was hit: one line, exit 4
        code = exit_code_of(error)
        output = traceback.format_exc().splitlines()[-OUTPUT_LINES:] if code == ExitCode.CRASHED else []
        if code == ExitCode.CRASHED and rank is None:
            traceback.print_exc()
        elif code != ExitCode.CRASHED and not quiet:
            print(f"lmyard: error: {one_line(error)}", file=sys.stderr, flush=True)
        where = failure_out or out
        if where:
            report = failed(code, one_line(error))
            if "status" in type(report).model_fields:  # NoSpace shares exit code 4 with StoreOutage
                report = report.model_copy(update={"status": status_of(error)})
            if rank is not None and "rank" in type(report).model_fields:
                report = report.model_copy(update={"rank": rank, "at": at, "output": output})
            try:
                write_json(where, report)
            except OSError:
                if not isinstance(error, NoSpace):
                    raise  # on a full disk the exit code alone says it
        return int(code)
    if out:
        write_json(out, result)
    return 0


def read_result(raw: bytes | str, cls: type[M]) -> M | StageError:
    """A stage's result file: its result, or the StageError of one whose exit code is not 0 (a TrainResult of a
    failed training is one too)."""
    data = json.loads(raw)
    if data.get("exit_code", 0) != 0:
        error = StageError.ended(ExitCode(data["exit_code"]), data.get("message") or data.get("status") or "failed")
        rank = {k: data[k] for k in ("rank", "at", "output") if data.get(k) is not None}
        error = error.model_copy(update=rank)
        return error.model_copy(update={"status": data["status"]}) if data.get("status") == "no_space" else error
    return cls.model_validate(data)


class RankExit(Contract):
    """A training rank's own exit code, recorded where lmyard's torchrun reads it: `<RANK_EXITS_ENV>/rank-R.json`."""

    rank: int
    code: int
    pid: int
    at: float  # time.time() as the rank ended


def rank_exit(code: int) -> int:
    """The exit code of a training rank whose stage ended with `code`.

    torchrun stops the other ranks of the node as soon as one exits non-zero, and gives them a fixed 30 s
    (torch's process context, whatever its shutdown timeout says): a rank still committing its preemption
    checkpoint to a slow store would be killed and the step lost. So under lmyard's torchrun (RANK_EXITS_ENV
    set) a preempted rank records its code there and exits 0, but the last of its node: that one exits 5, with
    no rank left for torchrun to stop. (A node whose ranks all exited 0 would wait in torchrun's exit barrier
    for the torchrun of every other node, up to 300 s: one that got the signal itself never comes.) lmyard's
    torchrun reports the recorded codes. Any other code (a crash, a full disk, a diverged loss...) is the exit
    code, for torchrun to stop the others, which wait on a broken collective; so is every code of a rank
    started any other way (plain torchrun, a Ray actor), or one whose record could not be written."""
    folder = os.environ.get(RANK_EXITS_ENV)
    if code != ExitCode.PREEMPTED or not folder:
        return code
    rank = int(os.environ.get("RANK", 0))
    try:
        write_json(
            os.path.join(folder, f"rank-{rank}.json"), RankExit(rank=rank, code=code, pid=os.getpid(), at=time.time())
        )
        ended = len(rank_exits(folder))  # this node's: the folder is its torchrun's
    except OSError:
        return code
    return code if ended >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else 0


def rank_exits(folder: str) -> list[RankExit]:
    """The exits the ranks recorded in `folder` (rank_exit), earliest first; [] when there are none."""
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    found.append(RankExit.model_validate_json(f.read()))
            except (OSError, ValueError):  # written atomically: only a file that is not a rank's
                continue
    return sorted(found, key=lambda e: (e.at, e.rank))


RANK_LINE = re.compile(r"^\[rank (\d+)\] ")  # how a training rank but 0 starts its lines (prefix_rank_lines)


class _RankLines:
    """A text stream that writes whole lines, each started with `prefix`: print's text and its newline are one write,
    so the ranks that share the job's output (unbuffered) never cut into each other's lines. A partial line waits
    for its newline or a flush. Reentrant: a signal handler that prints (the trainer's SIGTERM line) runs inside
    whatever write the main thread was in, and must not wait for its lock."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self.pending, self.at_start = stream, prefix, "", True
        self.lock = threading.RLock()

    def write(self, text: str) -> int:
        with self.lock:
            data, self.pending = self.pending + text, ""
            cut = data.rfind("\n") + 1
            self.pending = data[cut:] + self.pending  # what a handler left pending meanwhile stays after it
            if cut:
                self._out(data[:cut])
        return len(text)

    def flush(self) -> None:
        with self.lock:
            data, self.pending = self.pending, ""
            if data:
                self._out(data)
        self.stream.flush()

    def _out(self, text: str) -> None:
        out = []
        for piece in text.splitlines(keepends=True):
            out.append((self.prefix if self.at_start else "") + piece)
            self.at_start = piece.endswith("\n")
        self.stream.write("".join(out))

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def prefix_rank_lines(rank: int) -> None:
    """Every line this training rank prints starts with `[rank R] ` (but rank 0's: the job's voice): the launcher
    tells a rank's own output from the others' (the rank that failed first, its last lines), a person too. Each
    line is written whole (_RankLines), rank 0's too."""
    import sys

    prefix = f"[rank {rank}] " if rank != 0 else ""
    sys.stdout = _RankLines(sys.stdout, prefix)
    sys.stderr = _RankLines(sys.stderr, prefix)


_ENDING: list[int] | None = None  # the exit code exit_fast's atexit callback ends this process with


def exit_fast(main: Callable[[], int]) -> NoReturn:
    """`sys.exit(main())` for a `__main__` (a stage, torchrun's agent, a warm standby), without the interpreter's
    teardown of its modules: torch's took 1.5-3 s at every rank's end on the suite's CPUs, time between a preemption
    and the restart. Python's own shutdown still runs (threads that are not daemons joined, every atexit callback:
    this one is registered before main's imports register theirs, so it runs after them); then the streams are
    flushed and the process ends. Every file lmyard writes is closed when written: the teardown has nothing to keep."""
    global _ENDING
    if _ENDING is None:  # once a process: a rank run by a warm standby is the standby's to end
        _ENDING = [1]  # an exception out of main: Python prints its traceback, and exits 1
        atexit.register(_end, _ENDING)
    try:
        _ENDING[0] = main()
    except SystemExit as e:  # argparse's, a stage's own: Python still prints a message it carries
        _ENDING[0] = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        raise
    except KeyboardInterrupt:  # Python ends such a process by its SIGINT: so does _end
        _ENDING[0] = -signal.SIGINT
        raise
    sys.exit(_ENDING[0])


def _end(ending: list[int]) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more to say
            pass
    if ending[0] < 0:
        signal.signal(-ending[0], signal.SIG_DFL)
        os.kill(os.getpid(), -ending[0])
    os._exit(ending[0] if ending[0] >= 0 else 128 - ending[0])
