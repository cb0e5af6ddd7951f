"""One writer per lineage: the lease on runs/<run_name>/lease.json on a local store, the fence that stops a holder
which lost its lease, and corrupt lease files (the same on S3, and two `lmyard run` of one lineage at once:
tests/integration/test_lease_integration.py)."""

from __future__ import annotations

import time

import pytest
from lease_helpers import *  # noqa: F403  the tests both tiers run, on this module's `store`
from lease_helpers import _stall

from lmyard.errors import LeaseLost
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking import lease


@pytest.fixture(params=["local"])  # on S3 (the S3 test server): tests/integration/test_lease_integration.py
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def test_a_released_lease_leaves_no_lock_in_a_folder_made_for_it(tmp_path):
    store = open_store(str(tmp_path / "store"))
    lease.acquire(Run("r", store), {"flow_run": "refused-run"}, ttl_s=3, wait_s=0).release()
    assert not (tmp_path / "store" / "runs" / "r").exists()
    store.write_bytes("runs/kept/lineage.json", b"{}")  # a lineage that exists keeps its folder
    lease.acquire(Run("kept", store), {}, ttl_s=3, wait_s=0).release()
    assert (tmp_path / "store" / "runs" / "kept" / "lineage.json").exists()


def test_a_step_of_the_wall_clock_stops_neither_the_holder_nor_its_trainer_but_a_stall_still_does(
    tmp_path, monkeypatch
):
    """NTP stepping the clock 90 s forward makes the last heartbeat look older than the ttl by the wall clock;
    the holder and the fence know from their monotonic clocks that it was renewed a moment ago."""
    store = open_store(str(tmp_path / "store"))
    held = lease.acquire(Run("r", store), {"flow_run": "first-run"}, ttl_s=3, wait_s=0)
    fence = lease.Fence(Run("r", store), held.ref)
    fence.check()
    first, deadline = fence.seen, time.monotonic() + 60
    while fence.seen == first and time.monotonic() < deadline:  # until the fence sees one renewal
        time.sleep(0.05)
        fence.check()
    assert fence.seen != first, "the heartbeat was never renewed"
    _stall(held)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 90)
    held.check()
    fence.check()
    time.sleep(2.2)  # now the heartbeat is older than 2/3 of the ttl by the monotonic clocks too
    with pytest.raises(LeaseLost, match=r"heartbeat is \d s old"):
        fence.check()
    with pytest.raises(LeaseLost, match=r"heartbeat is \d s old"):
        held.check()
    held.release()
