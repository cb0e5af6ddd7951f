"""The lease tests' shared parts (on a local folder and on S3): a holder whose heartbeat stops, a checkpoint
saved through a writer, and the tests both tiers run on their own `store` fixture (a local folder:
tests/unit/tracking/test_lease.py; S3: tests/integration/test_lease_integration.py), imported by each."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
import torch

from lmyard.checkpoint.catalog import complete_steps
from lmyard.checkpoint.checkpointer import make_checkpointer
from lmyard.config import RunConfig
from lmyard.errors import LeaseLost, UserError
from lmyard.layout import RunLayout
from lmyard.run import Run
from lmyard.tracking import lease

# the tests both tiers run: `from lease_helpers import *` in each, on its own `store` fixture
__all__ = [
    "test_second_acquirer_refuses_naming_the_holder",
    "test_concurrent_acquirers_one_wins_the_other_waits_for_the_release",
    "test_an_expired_lease_is_taken_over_and_a_live_one_is_renewed",
    "test_a_stale_holder_cannot_commit_a_checkpoint_once_its_lease_is_taken_over",
    "test_a_holder_whose_heartbeat_stalled_stops_before_another_can_take_over",
    "test_a_corrupt_lease_file_is_one_line_naming_it_and_the_fix",
]


def _stall(held: lease.Lease) -> None:
    """The holder's flow process stops (SIGSTOP): no more heartbeats; its trainer runs on."""
    held._stop.set()
    assert held._thread is not None
    held._thread.join()


def _save(writer, step: int) -> None:
    state = {"step": step, "cursor": 0, "tokens_seen": 0, "world_size": 1, "shard_address": "0" * 64}
    writer.save_state({"w": torch.full((4,), float(step))}, {"state": {}, "param_groups": []}, state, [])


def test_second_acquirer_refuses_naming_the_holder(store):
    first = lease.acquire(Run("r", store), {"flow_run": "first-run"}, ttl_s=30, wait_s=0)
    try:
        with pytest.raises(UserError) as e:
            lease.acquire(Run("r", store), {"flow_run": "second-run"}, ttl_s=30, wait_s=0.5)
        msg = str(e.value)
        assert "in use by another run" in msg and "first-run" in msg and socket.gethostname() in msg
        assert f"since {first.record['since']}" in msg and "\n" not in msg
    finally:
        first.release()
    assert not store.exists(RunLayout("r").lease)
    lease.acquire(Run("r", store), {"flow_run": "third-run"}, ttl_s=30, wait_s=0).release()


def test_concurrent_acquirers_one_wins_the_other_waits_for_the_release(store):
    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def take(name: str) -> None:
        start.wait()
        try:
            held = lease.acquire(Run("r", store), {"flow_run": name}, ttl_s=30, wait_s=20, poll_s=0.2)
        except UserError as e:
            results[name] = e
            return
        results[name] = time.monotonic()
        time.sleep(1.5)
        held.release()
        results[f"{name}-released"] = time.monotonic()

    threads = [threading.Thread(target=take, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results["a"], float) and isinstance(results["b"], float)
    first, second = sorted(("a", "b"), key=lambda n: results[n])
    assert results[second] >= results[f"{first}-released"]  # never both at once


def test_an_expired_lease_is_taken_over_and_a_live_one_is_renewed(store):
    key = RunLayout("r").lease
    stale = {
        "host": "gone-host",
        "pid": 1,
        "flow_run": "crashed-run",
        "token": "t",
        "since": "2026-01-01T00:00:00Z",
        "ttl_s": 5,
        "heartbeat": time.time() - 60,
    }
    store.write_bytes(key, json.dumps(stale).encode())
    held = lease.acquire(Run("r", store), {"flow_run": "new-run"}, ttl_s=3, wait_s=0)
    try:
        first = json.loads(store.read_bytes(key))
        assert first["flow_run"] == "new-run"
        time.sleep(2.5)  # the heartbeat renews every ttl/3 = 1 s
        assert json.loads(store.read_bytes(key))["heartbeat"] > first["heartbeat"]
        with pytest.raises(UserError, match="new-run"):
            lease.acquire(Run("r", store), {"flow_run": "other"}, ttl_s=3, wait_s=0)
    finally:
        held.release()


def test_a_stale_holder_cannot_commit_a_checkpoint_once_its_lease_is_taken_over(store, tmp_path):
    first = lease.acquire(Run("r", store), {"flow_run": "first-run"}, ttl_s=3, wait_s=0)
    fence = lease.Fence(Run("r", store), first.ref)
    writer = make_checkpointer(
        RunConfig(run_name="r"), Run("r", store, str(tmp_path / "cache")), 0, sharded=False, fence=fence.check
    )
    _save(writer, 1)
    writer.flush()  # its own lease: committed
    _stall(first)
    time.sleep(3.2)  # past the ttl: the lease may be taken over
    second = lease.acquire(Run("r", store), {"flow_run": "second-run"}, ttl_s=30, wait_s=0)
    try:
        assert second.ref.epoch == first.ref.epoch + 1 and second.ref.token != first.ref.token
        _save(writer, 2)
        with pytest.raises(LeaseLost, match="lease lost to .*second-run.*stopped without writing further"):
            writer.flush()
        assert complete_steps(Run("r", store)) == [1]  # step 2 never exists
        with pytest.raises(LeaseLost):
            fence.check()
    finally:
        second.release()
        with contextlib.suppress(LeaseLost):
            writer.close(timeout_s=5)


def test_a_holder_whose_heartbeat_stalled_stops_before_another_can_take_over(store):
    held = lease.acquire(Run("r", store), {"flow_run": "first-run"}, ttl_s=3, wait_s=0)
    fence = lease.Fence(Run("r", store), held.ref)
    fence.check()  # fresh: its own
    _stall(held)
    time.sleep(2.2)  # older than 2/3 of the ttl, younger than the ttl
    with pytest.raises(LeaseLost, match="heartbeat is 2 s old"):
        fence.check()
    with pytest.raises(UserError, match="in use by another run"):  # nobody can take it over yet
        lease.acquire(Run("r", store), {"flow_run": "second-run"}, ttl_s=3, wait_s=0)
    held.release()


@pytest.mark.parametrize("content", [b"{not json", b'{"host": "h", "pid": 1}', b"[1, 2]", b"\xff\xfe"])
def test_a_corrupt_lease_file_is_one_line_naming_it_and_the_fix(store, content):
    key = RunLayout("r").lease
    store.write_bytes(key, content)
    with pytest.raises(UserError) as e:
        lease.acquire(Run("r", store), {"flow_run": "new-run"}, ttl_s=3, wait_s=0)
    msg = str(e.value)
    assert f"lease {store.uri(key)} is corrupt" in msg and "delete it" in msg and "\n" not in msg
    store.delete(key)  # the fix it names works
    lease.acquire(Run("r", store), {"flow_run": "new-run"}, ttl_s=3, wait_s=0).release()
