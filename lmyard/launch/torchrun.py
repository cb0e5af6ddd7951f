"""torchrun as the launcher starts it: `python -m lmyard.launch.torchrun ARGS` is `python -m torch.distributed.run
ARGS` with two differences.

1. A preempted rank does not cut the others' commit short. torchrun stops its ranks in two ways:

   - torchrun itself gets a signal (a cancelled run, `docker stop`): it forwards it and
     kills what is left after TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which the launcher sets
     from `launch.grace_s` (lmyard.launch.follower.stage_env);
   - a rank exits non-zero: the agent notices it while polling and stops the others with
     its own fixed 30 s, whatever the timeout says (no public option reaches it). A rank
     that exited as preempted (5) would so have a rank still uploading its checkpoint to
     a slow store SIGKILLed 30 s later, and the step lost.

   So this program points RANK_EXITS_ENV at a folder of its own (the ranks inherit the
   agent's environment), where a preempted rank records its code and exits 0, but the last
   of the node, which exits 5 with no rank left to stop (lmyard.stages.rank_exit, called by
   the train stage; a node whose ranks all exited 0 would wait in torchrun's exit barrier
   for the other nodes' torchrun, which never comes from a node that got the signal). So
   torchrun lets every rank end on its own, within `launch.grace_s` (the trainer's budget).
   Any other failure (a crash, a full disk, a store outage, a diverged loss) still exits
   non-zero at once and makes torchrun stop the other ranks, which wait on a broken
   collective. Ranks started any other way (plain torchrun, Ray actors) exit 5 as before.
   Preempted ranks also wait for each other's commit before exiting (lmyard.train.
   components.Preemption.barrier).

2. A rank that fails ends it with one line, not torchrun's traceback of its own ChildFailedError. The ranks say
   why they failed themselves (one line for a known error, a traceback for a crash) and rank 0's result file
   carries it to the launcher; torchrun's own ~40-line report of the same failure, with a traceback of the
   agent, told a person nothing more and made a full disk or a bad config read like a crash. The line names the
   rank that failed first, by torchrun's report and the ranks' records (a record wins: it is the rank's own word,
   and torchrun may stop a preempted rank after it recorded its code); `exits/` in the exchange folder gets every
   code. The exit code is 5 when every rank that ended so was preempted, else what torchrun's uncaught error
   gave (1); signals reach the agent as before (the same process), and the agent's SignalException, once it
   has stopped the ranks, is one line (exit 1, as before), not its traceback.

It is a program, and nothing imports this module (it loads torch, which flows and tasks must not).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from lmyard.errors import ExitCode
from lmyard.stages import EXCHANGE_ENV, RANK_EXITS_ENV, RankExit, rank_exits


def main() -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

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
            return 1  # as torchrun's own uncaught SignalException exited, less its traceback
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
    print(f"torchrun: rank {first.rank} exited with code {first.code} (pid {first.pid})", file=sys.stderr)
    _record_exits({r: x.code for r, x in exits.items()})
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
    """The rank that failed first: one killed by a signal (negative code: SIGKILL by the OOM killer, a kill -9)
    before any that exited with an error (the others fail after it, on the broken collective), else the earliest."""
    return min(exits, key=lambda r: (exits[r] >= 0, timestamps.get(r, 0), r))


def _record_exits(exits: dict[int, int]) -> None:
    """Every failed rank's exit code, for the launcher (its exchange folder's exits/, one file per node)."""
    import json
    import socket

    folder = os.environ.get(EXCHANGE_ENV)
    if not folder:
        return
    os.makedirs(os.path.join(folder, "exits"), exist_ok=True)
    path = os.path.join(folder, "exits", f"{socket.gethostname()}-{os.getpid()}")
    with open(path, "w") as f:
        json.dump({str(rank): code for rank, code in exits.items()}, f)


if __name__ == "__main__":
    sys.exit(main())
