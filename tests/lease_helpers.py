"""The lease tests' shared parts (on a local folder and on S3): a holder whose heartbeat stops, a checkpoint
saved through a writer."""

from __future__ import annotations

import torch

from lmyard.tracking import lease


def _stall(held: lease.Lease) -> None:
    """The holder's flow process stops (SIGSTOP): no more heartbeats; its trainer runs on."""
    held._stop.set()
    assert held._thread is not None
    held._thread.join()


def _save(writer, step: int) -> None:
    state = {"step": step, "cursor": 0, "tokens_seen": 0, "world_size": 1, "shard_address": "0" * 64}
    writer.save_state({"w": torch.full((4,), float(step))}, {"state": {}, "param_groups": []}, state, [])
