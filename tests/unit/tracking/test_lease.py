"""One writer per lineage: the lease on runs/<run_name>/lease.json on a local store, the fence that stops a holder
which lost its lease, and corrupt lease files (the same on S3, and two `lmyard run` of one lineage at once:
tests/integration/test_lease_integration.py)."""

from __future__ import annotations

import pytest
from lease_helpers import (  # noqa: F401  the tests both tiers run, on this module's `store`
    test_a_corrupt_lease_file_is_one_line_naming_it_and_the_fix,
    test_a_holder_whose_heartbeat_stalled_stops_before_another_can_take_over,
    test_a_stale_holder_cannot_commit_a_checkpoint_once_its_lease_is_taken_over,
    test_an_expired_lease_is_taken_over_and_a_live_one_is_renewed,
    test_concurrent_acquirers_one_wins_the_other_waits_for_the_release,
    test_second_acquirer_refuses_naming_the_holder,
)

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
