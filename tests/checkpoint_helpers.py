"""Synchronous saves and loads for tests, built on the real checkpoint API (lmyard.checkpoint).

The trainer saves in the background (a Checkpointer); a test that needs a checkpoint in the store now saves
through the same writer and waits for its commit.
"""

from __future__ import annotations

import torch.distributed as dist

from lmyard.checkpoint import resume
from lmyard.checkpoint.commit import RetryPolicy, publish
from lmyard.checkpoint.dcp import ShardedCheckpointer
from lmyard.checkpoint.full import FILES, FullCheckpointer
from lmyard.checkpoint.manifest import Manifest
from lmyard.layout import RunLayout


def save_full(store, run_name: str, step: int, model: dict, optim: dict, rng: list, state: dict, staging: str) -> str:
    """State dicts as the `full` checkpoint of `step`, committed when this returns; its URI."""
    writer = FullCheckpointer(store, run_name, staging, say=lambda s: None)
    writer.save_state(model, optim or {"state": {}, "param_groups": []}, {**state, "step": step}, rng)
    writer.close()
    return store.uri(RunLayout(run_name).step(step))


def save_sharded(store, run_name: str, model, optimizer, state: dict, staging: str, rng=None, **kwargs) -> str:
    """A sharded checkpoint (every rank calls it), committed when this returns on every rank; its URI."""
    writer = ShardedCheckpointer(store, run_name, staging, say=lambda s: None, **kwargs)
    try:
        writer.save(model, optimizer, state, rng)
        writer.flush()
    finally:
        writer.close()
    if writer.group is not None and writer.world > 1:
        dist.barrier(group=writer.group)  # every rank returns once rank 0 has committed
    if writer.owns_group:
        dist.destroy_process_group(writer.group)
    return store.uri(RunLayout(run_name).step(int(state["step"])))


def commit_folder(store, run_name: str, folder: str, manifest: dict) -> str:
    """The files of a `full` checkpoint staged in `folder`, then `manifest`: the commit the writer makes."""
    files = {name: f"{folder}/{name}" for name in FILES}
    return publish(store, run_name, files, Manifest.model_validate(manifest), RetryPolicy(), folder)


def load_latest(store, run_name: str, cache_dir: str):
    """The newest checkpoint that loads whole (damaged ones skipped with a warning), or None."""
    return resume.find_latest(store, run_name, cache_dir)[0]


def load_latest_sharded(store, run_name: str, model, optimizer, cache_dir: str):
    """The newest checkpoint (either format) loaded into a sharded model on every rank, or None."""
    return resume.load_latest(store, run_name, model, optimizer, cache_dir, sharded=True)[0]
