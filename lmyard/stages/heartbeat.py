"""Step heartbeats: the file protocol between the training ranks and the launcher's watchdog.

Every rank writes its step number to `<exchange>/heartbeat/rank-<R>` when it completes a step (the exchange
folder comes from LMYARD_EXCHANGE_DIR, set by the launcher). The launcher's follow loop reads them about once a
second -- from the local folder (`read_beats`), or from each container through its engine -- and hands them to
its watchdog (lmyard.launch.watchdog).
"""

from __future__ import annotations

import os

from lmyard.stages.exchange import Exchange


class Heartbeat:
    """The trainer's side: one file per rank holding the last completed step."""

    def __init__(self, rank: int):
        exchange = Exchange.from_env()
        self.path = None
        if exchange is not None:
            os.makedirs(exchange.heartbeats, exist_ok=True)
            self.path = os.path.join(exchange.heartbeats, f"rank-{rank}")

    def beat(self, step: int) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(str(step))
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
