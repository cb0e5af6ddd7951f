"""torchrun as the launcher starts it: `python -m lmyard.launch.torchrun ARGS` is `python -m torch.distributed.run
ARGS` with two differences.

1. Every shutdown honours the shutdown timeout. torchrun stops its ranks in two ways:

   - torchrun itself gets a signal (a cancelled run, `docker stop`): it forwards it and
     kills what is left after TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which the launcher sets
     from `launch.grace_s` (lmyard.launch.follower.stage_env);
   - a rank exits with an error (a preempted rank exits 5): the agent's process context
     notices it while polling and closes the others with its default 30 s, whatever the
     timeout says (`PContext._poll` -> `close()`, and `_stop_workers` -> `_shutdown()`).
     A preempted rank still uploading its checkpoint to a slow store is SIGKILLed 30 s
     later and the step is lost.

   Preempted ranks wait for each other's commit before exiting (lmyard.train.components.
   Preemption.barrier), so the second path is rare; it still must not cut a commit short.
   Every close of the ranks here waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT. torchrun's own
   option (`--shutdown-timeout`, or that variable) reaches only the first path, and no
   public option the second, so PContext.close is rebound here: the one patch of torch
   in lmyard, listed in tests/test_habits.py, which also fails if torch changes the method.

2. A rank that fails ends it with one line, not torchrun's traceback of its own ChildFailedError. The ranks say
   why they failed themselves (one line for a known error, a traceback for a crash) and rank 0's result file
   carries it to the launcher; torchrun's own ~40-line report of the same failure, with a traceback of the
   agent, told a person nothing more and made a full disk or a bad config read like a crash. The exit code stays
   what torchrun's uncaught error gave (1); signals reach the agent as before (the same process).

It is a program: the patch is made only under `__main__`, and nothing imports this module (it loads torch,
which flows and tasks must not).
"""

from __future__ import annotations

import os
import signal
import sys

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    torch_close = PContext.close

    def close(self: PContext, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        """PContext.close with the configured grace, wherever it is called from."""
        torch_close(self, death_sig, int(os.environ.get(SHUTDOWN_TIMEOUT_ENV, timeout)))

    PContext.close = close  # type: ignore[method-assign]
    try:
        torchrun()
    except ChildFailedError as e:
        exits = {rank: f.exitcode for rank, f in e.failures.items()}
        rank = first_to_fail(exits, {rank: f.timestamp for rank, f in e.failures.items()})
        failure = e.failures[rank]
        print(f"torchrun: rank {rank} exited with code {failure.exitcode} (pid {failure.pid})", file=sys.stderr)
        _record_exits(exits)
        return 1
    return 0


def first_to_fail(exits: dict[int, int], timestamps: dict[int, int]) -> int:
    """The rank that failed first: one killed by a signal (negative code: SIGKILL by the OOM killer, a kill -9)
    before any that exited with an error (the others fail after it, on the broken collective), else the earliest."""
    return min(exits, key=lambda r: (exits[r] >= 0, timestamps.get(r, 0), r))


def _record_exits(exits: dict[int, int]) -> None:
    """Every failed rank's exit code, for the launcher (its exchange folder's exits/, one file per node)."""
    import json
    import socket

    folder = os.environ.get("LMYARD_EXCHANGE_DIR")
    if not folder:
        return
    os.makedirs(os.path.join(folder, "exits"), exist_ok=True)
    path = os.path.join(folder, "exits", f"{socket.gethostname()}-{os.getpid()}")
    with open(path, "w") as f:
        json.dump({str(rank): code for rank, code in exits.items()}, f)


if __name__ == "__main__":
    sys.exit(main())
