"""One writer per lineage: the lease on runs/<run_name>/lease.json on a local store, the fence that stops a holder
which lost its lease, and corrupt lease files (the same on S3, and two `lmyard run` of one lineage at once:
tests/integration/test_lease_integration.py)."""

from __future__ import annotations

import pytest
from lease_helpers import *  # noqa: F403  the tests both tiers run, on this module's `store`

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
