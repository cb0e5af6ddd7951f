"""Which rank of a failed training failed first, and the failure said once: one line and that rank's last lines.

When one rank dies the others fail on the collective that waits for it (symptoms). The first is the rank a
signal other than torchrun's SIGTERM killed, else the earliest to end by itself, else the earliest SIGTERMed:
by its own failure record's time (lmyard.stages.run_stage), else torchrun's (whole seconds, counted a second
early: a rank that died without a word went before ranks that raised on its absence). Ranks torchrun saw end
are the candidates; those it stopped follow them. The error:
`rank 1 exited with code 1 first: <its message or last line>; rank 0 failed after it`, with at most
OUTPUT_LINES lines of that rank's own output (`[rank R] ` starts every rank's lines but rank 0's).
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import dataclass, field

from lmyard.errors import ExitCode, TrainingFailed, error_for
from lmyard.stages import StageError
from lmyard.stages.runtime import OUTPUT_LINES

AGENT = "torchrun: "  # how lmyard's torchrun starts its own lines (lmyard.launch.torchrun): no rank's output


@dataclass
class RankEnd:
    """How one rank ended, as far as the launcher can tell."""

    rank: int
    code: int | None = None  # torchrun's exit code for it (negative: a signal); None: torchrun did not see it end
    at: float | None = None  # when torchrun saw it end (whole seconds)
    record: StageError | None = None  # its own failure record

    @property
    def when(self) -> float:
        if self.record is not None and self.record.at is not None:
            return self.record.at
        return self.at - 1.0 if self.at is not None else math.inf


@dataclass
class Cause:
    """The rank that failed first, the ranks that failed after it, and that rank's own last lines."""

    first: RankEnd
    followers: list[int]
    output: list[str] = field(default_factory=list)
    printed: bool = True  # the output was on the log already (False: from its record, not printed)

    def headline(self, stage: str) -> str:
        first = self.first
        if first.code is not None and first.code < 0:
            what = f"{killed_by_signal({first.rank: first.code})}"
        elif first.code is not None or first.record is not None:
            code = first.code if first.code is not None else first.record.exit_code  # type: ignore[union-attr]
            what = f"rank {first.rank} exited with code {code}"
        else:
            what = f"rank {first.rank} failed"
        detail = first.record.message if first.record is not None and first.record.message else None
        if detail is None and self.output:
            detail = self.output[-1].strip()
        text = f"{stage}: {what}" + (" first" if self.followers else "") + (f": {detail}" if detail else "")
        if self.followers:
            ranks = ", ".join(str(r) for r in self.followers)
            text += f"; rank{'s' if len(self.followers) > 1 else ''} {ranks} failed after it"
        return text

    def error(self, stage: str) -> Exception:
        """The exception the job's end raises: what the first rank's record names, else TrainingFailed."""
        record = self.first.record
        if record is not None and record.exit_code not in (ExitCode.CRASHED, ExitCode.PREEMPTED):
            return error_for(record.exit_code, self.headline(stage), record.status)
        return TrainingFailed(self.headline(stage), output=self.output)


def rank_ends(exits: dict[str, bytes], times: dict[str, bytes], records: list[StageError]) -> dict[int, RankEnd]:
    """Every rank that ended with a failure: torchrun's files of every node (`exits/`, `exit-times/`) and the
    ranks' own records."""
    ends: dict[int, RankEnd] = {}
    for raw in exits.values():
        for rank, code in _numbers(raw).items():
            ends.setdefault(rank, RankEnd(rank)).code = int(code)
    for raw in times.values():
        for rank, at in _numbers(raw).items():
            ends.setdefault(rank, RankEnd(rank)).at = at
    for record in records:
        if record.rank is not None:
            ends.setdefault(record.rank, RankEnd(record.rank)).record = record
    return ends


def _numbers(raw: bytes) -> dict[int, float]:
    try:
        return {int(r): float(v) for r, v in json.loads(raw).items()}
    except (ValueError, AttributeError, TypeError):
        return {}


def first_cause(ends: dict[int, RankEnd], printed: dict[int, list[str]]) -> Cause:
    """The rank that failed first among `ends` (see the module docstring), with its last lines: its record's
    traceback, else what it printed (`printed`, by rank)."""
    seen = [r for r, e in ends.items() if e.code is not None] or list(ends)
    codes = {r: e.code for r, e in ends.items()}
    rank = min(seen, key=lambda r: (signal_order(codes[r]), ends[r].when, r))
    first = ends[rank]
    if first.record is not None and first.record.output:
        return Cause(first, sorted(set(ends) - {rank}), first.record.output[-OUTPUT_LINES:], printed=False)
    return Cause(first, sorted(set(ends) - {rank}), printed.get(rank, [])[-OUTPUT_LINES:])


def signal_order(code: int | None) -> int:
    """Which kind of failed rank goes first (a rank's exit `code`; negative: the signal that ended it). 0: killed by
    a signal the agent did not send (SIGKILL: the OOM killer, a kill -9), a cause; 1: ended by itself; 2: SIGTERM,
    how torchrun stops the ranks left once one has failed, so never before a rank that ended by itself, whatever
    the (whole-second, loaded-machine) times say. The launcher's first_cause and the node's first_to_fail."""
    if code is not None and code < 0:
        return 2 if code == -signal.SIGTERM else 0
    return 1


def killed_by_signal(exits: dict[int, int]) -> str | None:
    """Words on the ranks a signal ended (torchrun reports them with a negative code), or None."""
    killed = sorted((r, -c) for r, c in exits.items() if c < 0)
    if not killed:
        return None
    names = {signal.SIGKILL: "SIGKILL: the kernel's out-of-memory killer, or a kill -9", signal.SIGTERM: "SIGTERM"}
    words = [
        f"rank {r} was killed by signal {sig} ({names.get(signal.Signals(sig), signal.Signals(sig).name)})"
        if sig in signal.Signals._value2member_map_
        else f"rank {r} was killed by signal {sig}"
        for r, sig in killed
    ]
    return "; ".join(words)
