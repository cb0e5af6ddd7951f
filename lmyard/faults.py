"""Fault injection for tests and failure drills.

    LMYARD_FAULTS="nan_loss@7,crash@12"

`nan_loss@S` makes the loss of step S non-finite (once per process);
`crash@S` exits the trainer process with status 1 right after step S.
Unset in production: nothing here fires.
"""

from __future__ import annotations

import os

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
    return True
