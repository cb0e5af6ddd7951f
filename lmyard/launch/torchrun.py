"""torchrun as the launcher starts it: `python -m lmyard.launch.torchrun ARGS` is `python -m torch.distributed.run
ARGS` with two differences.

Design notes: docs/launch.md, `lmyard/launch/torchrun.py`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

from lmyard.errors import ExitCode
from lmyard.launch.cause import AGENT, signal_order
from lmyard.stages import EXCHANGE_ENV, RANK_EXITS_ENV, RankExit, rank_exits
from lmyard.stages.runtime import exit_fast


def main() -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torch's own lines on the ranks it started, stopped and saw fail: node_code says the failure in one line
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    folder = _rank_exits_folder()
    if folder:
        os.environ[RANK_EXITS_ENV] = folder  # before torchrun's agent starts the ranks with its environment
    try:
        failures = []
        try:
            torchrun()
        except ChildFailedError as e:
            failures = [RankExit(rank=r, code=f.exitcode, pid=f.pid, at=f.timestamp) for r, f in e.failures.items()]
        except SignalException as e:  # its agent stopped the ranks already; the launcher said why it signalled
            print(f"torchrun: stopped by {e.sigval.name}; its ranks were stopped first", file=sys.stderr)
            # the ranks' own records say whether they committed their preemption checkpoint (5) or not (1)
            records = {x.rank: x for x in rank_exits(folder)} if folder else {}
            return node_code(records) if records else 1
        # a rank's own record wins: torchrun may have stopped a preempted rank after it recorded, its work done
        return node_code({x.rank: x for x in [*failures, *(rank_exits(folder) if folder else [])]})
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def node_code(exits: dict[int, RankExit]) -> int:
    """The node's exit code from its ranks' failures and records: 0 for none; else, after one line naming the rank
    that failed first and the node's `exits/` record, 5 when every rank that ended so was preempted, else 1."""
    if not exits:
        return 0
    first = exits[first_to_fail({r: x.code for r, x in exits.items()}, {r: x.at for r, x in exits.items()})]
    print(f"{AGENT}rank {first.rank} exited with code {first.code} (pid {first.pid})", file=sys.stderr)
    _record_exits({r: x.code for r, x in exits.items()}, {r: x.at for r, x in exits.items()})
    return ExitCode.PREEMPTED if {x.code for x in exits.values()} == {ExitCode.PREEMPTED} else 1


def _rank_exits_folder() -> str | None:
    """A fresh folder for the ranks' exit records: in the exchange folder when there is one (removed with the job
    whatever happens to this process), else in the system's temporary folder; None where none can be made (a full
    disk: the ranks then exit with their codes, as under plain torchrun)."""
    base = os.environ.get(EXCHANGE_ENV) or None
    try:
        if base:
            os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix="rank-exits-", dir=base)
    except OSError:
        return None


def first_to_fail(exits: dict[int, int], timestamps: dict[int, float]) -> int:
    """The rank that failed first: by `signal_order` (a kill -9 before a rank that exited with an error, and that
    before one the agent SIGTERMed), then the earliest."""
    return min(exits, key=lambda r: (signal_order(exits[r]), timestamps.get(r, 0), r))


def _record_exits(exits: dict[int, int], times: dict[int, float]) -> None:
    """Every failed rank's exit code and time, for the launcher (its exchange folder's exits/ and exit-times/, one
    file per node; a time is torchrun's, in whole seconds, or the rank's own record's)."""
    import json
    import socket

    folder = os.environ.get(EXCHANGE_ENV)
    if not folder:
        return
    for sub, values in (("exits", exits), ("exit-times", times)):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
        with open(os.path.join(folder, sub, f"{socket.gethostname()}-{os.getpid()}"), "w") as f:
            json.dump({str(rank): value for rank, value in values.items()}, f)


if __name__ == "__main__":
    exit_fast(main)
