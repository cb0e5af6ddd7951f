"""Fault injection for tests and failure drills.

    LMYARD_FAULTS="nan_loss@7,crash@12"

Design notes: docs/operations.md, `lmyard/faults.py`.
"""

from __future__ import annotations

import os
import time

_fired: set[tuple[str, int]] = set()


def _planned() -> set[tuple[str, int]]:
    out = set()
    for item in filter(None, (x.strip() for x in os.environ.get("LMYARD_FAULTS", "").split(","))):
        kind, _, step = item.partition("@")
        out.add((kind, int(step)))
    return out


def fires(kind: str, step: int) -> bool:
    """True the first time `kind@step` is planned and reached in this process."""
    key = (kind, step)
    if key in _fired or key not in _planned():
        return False
    _fired.add(key)
    state = os.environ.get("LMYARD_FAULTS_STATE")
    if state:
        marker = os.path.join(state, f"{kind}@{step}")
        try:
            os.makedirs(state, exist_ok=True)
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # the first process to get here
            os.close(fd)
        except FileExistsError:
            return False
    return True


def delay(kind: str, step: int, env: str, default_s: float) -> bool:
    """Sleep `env` seconds (default `default_s`) the first time `kind@step` fires; whether it did."""
    if not fires(kind, step):
        return False
    time.sleep(float(os.environ.get(env, str(default_s))))
    return True
