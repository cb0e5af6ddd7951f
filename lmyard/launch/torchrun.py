"""torchrun whose every shutdown honours its shutdown timeout: `python -m lmyard.launch.torchrun ARGS`.

`python -m torch.distributed.run` (torchrun) stops its ranks in two ways:

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
This entrypoint makes every close of the ranks wait TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
then runs torchrun unchanged. It is a program: the patch is made only under `__main__`,
and nothing imports this module (it loads torch, which flows and tasks must not).
"""

from __future__ import annotations

import os
import signal

from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.run import main

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_torch_close = PContext.close


def _close(self: PContext, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
    """PContext.close with the configured grace, wherever it is called from."""
    _torch_close(self, death_sig, int(os.environ.get(SHUTDOWN_TIMEOUT_ENV, timeout)))


if __name__ == "__main__":
    PContext.close = _close  # type: ignore[method-assign]
    main()
