"""torchrun as the launcher starts it: `python -m lmyard.launch.torchrun ARGS` is `python -m torch.distributed.run
ARGS`, but a rank that fails ends it with one line, not torchrun's traceback of its own ChildFailedError.

The ranks say why they failed themselves (one line for a known error, a traceback for a crash) and rank 0's
result file carries it to the launcher; torchrun's own ~40-line report of the same failure, with a traceback
of the agent, told a person nothing more and made a full disk or a bad config read like a crash. The exit
code stays what torchrun's uncaught error gave (1); signals reach the agent as before (the same process).
"""

from __future__ import annotations

import sys


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"torchrun: rank {rank} exited with code {failure.exitcode} (pid {failure.pid})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
