"""One backoff for every retry loop: `Backoff` says how long to wait after a failed attempt, `retrying` calls
until a call succeeds or its attempts are spent.

The checkpoint uploads (lmyard.checkpoint.commit: 1, 2, 4 ... 30 s), the checkpoint reads on resume
(lmyard.checkpoint.resume: 2, 4 s) and the evaluator's patience with an unreachable store (tasks/evaluate.py:
as long as the uploads would retry) are each a Backoff.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """`base_s * 2**attempt` seconds after the failed attempt `attempt` (from 0), the exponent at most
    `doublings`, the wait at most `cap_s`."""

    base_s: float
    cap_s: float = math.inf
    doublings: int | None = None

    def delay(self, attempt: int) -> float:
        exponent = attempt if self.doublings is None else min(attempt, self.doublings)
        return min(self.cap_s, self.base_s * 2**exponent)

    def total(self, attempts: int) -> float:
        """The seconds waited after `attempts` failed attempts."""
        return sum(self.delay(i) for i in range(attempts))


def retrying(
    call: Callable[[], T],
    backoff: Backoff,
    attempts: int,
    *,
    fatal: tuple[type[BaseException], ...] = (),
    on_failure: Callable[[Exception, int, float | None], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`call()`'s result, calling it at most `attempts` times and waiting `backoff.delay(attempt)` after each
    failure. An exception in `fatal` propagates at once. After a failure `on_failure(error, attempt, delay)` runs
    (delay None after the last attempt: it may raise the caller's own exception then); the last failure is
    raised when it does not."""
    for attempt in range(attempts):
        try:
            return call()
        except fatal:
            raise
        except Exception as e:
            delay = backoff.delay(attempt) if attempt < attempts - 1 else None
            if on_failure is not None:
                on_failure(e, attempt, delay)
            if delay is None:
                raise
            sleep(delay)
    raise ValueError(f"retrying needs at least one attempt, not {attempts}")
