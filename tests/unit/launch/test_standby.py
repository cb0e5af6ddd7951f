"""Warm standbys (lmyard.launch.standby): which ranks a standby takes, and where standbys are on (preempted
attempts restarting in them: tests/integration/test_standby_integration.py)."""

from __future__ import annotations

from lmyard.launch import standby


def test_a_standby_takes_ranks_that_differ_only_in_per_rank_and_per_attempt_variables():
    started = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LMYARD_EXCHANGE": "/a", "RANK": "0"}
    rank = {**started, "LMYARD_EXCHANGE": "/b", "RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    assert standby.differs(started, rank) == []
    assert standby.differs(started, {**rank, "OMP_NUM_THREADS": "4", "TORCHINDUCTOR_CACHE_DIR": "/c"}) == [
        "OMP_NUM_THREADS",
        "TORCHINDUCTOR_CACHE_DIR",
    ]
    assert standby.differs(started, {k: v for k, v in rank.items() if k != "PATH"}) == ["PATH"]


def test_standbys_are_on_where_asked_and_never_for_cpu_training_by_default():
    assert standby.wanted(True, "cpu") and not standby.wanted(False, "cuda")
    assert not standby.wanted(None, "cpu")
