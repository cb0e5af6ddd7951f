"""Step heartbeats: the file protocol between the training ranks and the launcher's watchdog.

Every rank writes its step number to `<exchange>/heartbeat/rank-<R>` when it completes a step (the exchange
folder comes from LMYARD_EXCHANGE_DIR, set by the launcher), and `<step> finished` once its loop has ended (what
follows, the last upload and the exit, is not a step and is not watched). The launcher's follow loop reads them about once a
second -- from the local folder (`read_beats`), or from each container through its engine -- and hands them to
its watchdog (lmyard.launch.watchdog).
"""

from __future__ import annotations

import os

from lmyard.stages.exchange import Exchange

FINISHED = "finished"  # the heartbeat's suffix once a rank's training loop has ended


class Heartbeat:
    """The trainer's side: one file per rank holding the last completed step."""

    def __init__(self, rank: int):
        exchange = Exchange.from_env()
        self.path = None
        if exchange is not None:
            os.makedirs(exchange.heartbeats, exist_ok=True)
            self.path = os.path.join(exchange.heartbeats, f"rank-{rank}")

    def beat(self, step: int) -> None:
        self._write(str(step))

    def finish(self, step: int) -> None:
        """The loop has ended at `step`: the watchdog stops watching this rank."""
        self._write(f"{step} {FINISHED}")

    def _write(self, text: str) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)


def read_beats(folder: str) -> dict[str, str]:
    """rank name -> last step, from a local heartbeat folder."""
    out: dict[str, str] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".tmp") or name.startswith("."):  # files being written
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                out[name] = f.read().strip()
        except OSError:
            continue
    return out
