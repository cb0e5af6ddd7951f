"""A full cache disk: the checkpointer's discard gives the run's staging space back (lmyard.checkpoint.full)."""

from __future__ import annotations

import threading
import time

import torch

from lmyard.checkpoint import full
from lmyard.checkpoint.full import FullCheckpointer
from lmyard.run import Run
from lmyard.store import open_store


def test_a_discard_while_a_checkpoint_is_being_staged_leaves_no_staging_folder(tmp_path, monkeypatch):
    """The run fails on a full cache disk while its serializer is about to stage a checkpoint (another write hit
    the full disk first): the folder that serializer makes must not outlive the discard."""
    real_stage, entered, discarding, staged = full.stage, threading.Event(), threading.Event(), threading.Event()

    def stage_once_discarded(folder, *args):
        entered.set()
        assert discarding.wait(30), "discard() was not called"
        time.sleep(0.2)  # the discard's delete has had its chance to run before this folder is made
        try:
            return real_stage(folder, *args)
        finally:
            staged.set()

    monkeypatch.setattr(full, "stage", stage_once_discarded)
    writer = FullCheckpointer(Run("full", open_store(str(tmp_path / "store"))), str(tmp_path / "staging"))
    state = {"step": 2, "cursor": 0, "tokens_seen": 0, "world_size": 1, "shard_address": "a"}
    writer.save_state({"w": torch.ones(1024)}, {"state": {}, "param_groups": []}, state, [])
    assert entered.wait(30), "the serializer did not take the checkpoint"
    discarding.set()
    writer.discard()
    assert staged.is_set(), "discard() returned before the checkpoint in flight was staged"
    assert not (tmp_path / "staging" / "full").exists()
