"""A full cache disk: each checkpointer's discard gives the run's staging space back (lmyard.checkpoint.full, .dcp)."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed.checkpoint as torch_dcp

from lmyard.checkpoint import dcp, full
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


def test_a_discard_while_a_sharded_checkpoint_is_being_written_leaves_no_staging_folder(tmp_path, monkeypatch):
    """The same for the sharded format: DCP's write in flight makes its folder after the discard began, and no
    upload or commit of that step follows the discard."""
    discarding = threading.Event()

    class HeldWriter(torch_dcp.FileSystemWriter):  # DCP's own writer, held until the discard has begun
        def prepare_local_plan(self, plan):
            assert discarding.wait(30), "discard() was not called"
            time.sleep(0.2)  # the discard's delete has had its chance to run before the folder is made
            return super().prepare_local_plan(plan)

    monkeypatch.setattr(dcp.dcp, "FileSystemWriter", HeldWriter)
    store = open_store(str(tmp_path / "store"))
    writer = dcp.ShardedCheckpointer(Run("sharded", store), str(tmp_path / "staging"), say=lambda line: None)
    model = torch.nn.Linear(8, 8)
    state = {"step": 2, "cursor": 0, "tokens_seen": 0, "world_size": 1, "shard_address": "a"}
    writer.save(model, torch.optim.AdamW(model.parameters()), state, [])
    discarding.set()
    writer.discard()
    writer.thread.join(30)
    assert not writer.thread.is_alive()
    assert not (tmp_path / "staging" / "sharded").exists()
    assert not list((tmp_path / "store").rglob("manifest.json")), "a discarded step was committed"
