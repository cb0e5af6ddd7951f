"""lmyard.retry: the one backoff of every retry loop (checkpoint uploads, checkpoint reads, the evaluator's
patience with the store)."""

from __future__ import annotations

import pytest

from lmyard.checkpoint.commit import Parked, RetryPolicy, upload_backoff
from lmyard.retry import Backoff, retrying


class Flaky:
    """Fails its first `failures` calls with `error`, then returns "ok"."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


def test_the_upload_backoff_doubles_from_one_second_to_thirty_and_the_reads_from_two_uncapped():
    assert [upload_backoff().delay(i) for i in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert [upload_backoff(0.1).delay(i) for i in range(8)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 3.2, 3.2])
    assert [Backoff(2.0).delay(i) for i in range(3)] == [2, 4, 8]
    assert upload_backoff().total(7) == 1 + 2 + 4 + 8 + 16 + 30 + 30  # checkpoint.upload_retries=6: one round


def test_retrying_waits_the_backoff_between_failures_and_returns_the_first_success():
    slept: list[float] = []
    flaky = Flaky(2, OSError("down"))
    assert retrying(flaky, Backoff(2.0), 3, sleep=slept.append) == "ok"
    assert flaky.calls == 3 and slept == [2.0, 4.0]


def test_retrying_raises_the_last_failure_once_the_attempts_are_spent_and_a_fatal_one_at_once():
    seen: list[tuple[int, float | None]] = []
    flaky = Flaky(5, OSError("down"))
    with pytest.raises(OSError, match="down"):
        retrying(flaky, Backoff(1.0), 3, on_failure=lambda e, a, d: seen.append((a, d)), sleep=lambda s: None)
    assert flaky.calls == 3 and seen == [(0, 1.0), (1, 2.0), (2, None)]
    fatal = Flaky(5, KeyError("gone"))
    with pytest.raises(KeyError):
        retrying(fatal, Backoff(1.0), 3, fatal=(KeyError,), sleep=lambda s: None)
    assert fatal.calls == 1


def test_an_upload_round_says_each_retry_and_parks_the_checkpoint_when_spent(tmp_path):
    said: list[str] = []
    policy = RetryPolicy(retries=2, backoff_s=0.01, say=said.append)
    flaky = Flaky(1, OSError("blip"))
    assert policy.run(7, str(tmp_path), flaky) == "ok" and policy.failures == 0
    assert said == ["checkpoint step 7: upload failed (blip); retrying in 0s"]
    with pytest.raises(Parked, match="parked"):
        policy.run(8, str(tmp_path), Flaky(9, OSError("down")))
    assert policy.failures == 3
