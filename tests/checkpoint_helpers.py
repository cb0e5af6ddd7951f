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
from lmyard.run import Run


def save_full(run: Run, step: int, model: dict, optim: dict, rng: list, state: dict, staging: str) -> str:
    """State dicts as the `full` checkpoint of `step`, committed when this returns; its URI."""
    writer = FullCheckpointer(run, staging, say=lambda s: None)
    writer.save_state(model, optim or {"state": {}, "param_groups": []}, {**state, "step": step}, rng)
    writer.close()
    return run.uri(run.layout.step(step))


def save_sharded(run: Run, model, optimizer, state: dict, staging: str, rng=None, **kwargs) -> str:
    """A sharded checkpoint (every rank calls it), committed when this returns on every rank; its URI."""
    writer = ShardedCheckpointer(run, staging, say=lambda s: None, **kwargs)
    try:
        writer.save(model, optimizer, state, rng)
        writer.flush()
    finally:
        writer.close()
    if writer.group is not None and writer.world > 1:
        dist.barrier(group=writer.group)  # every rank returns once rank 0 has committed
    if writer.owns_group:
        dist.destroy_process_group(writer.group)
    return run.uri(run.layout.step(int(state["step"])))


def commit_folder(run: Run, folder: str, manifest: dict) -> str:
    """The files of a `full` checkpoint staged in `folder`, then `manifest`: the commit the writer makes."""
    files = {name: f"{folder}/{name}" for name in FILES}
    return publish(run, files, Manifest.model_validate(manifest), RetryPolicy(), folder)


def load_latest(run: Run, cache_dir: str):
    """The newest checkpoint that loads whole (damaged ones skipped with a warning), or None."""
    return resume.find_latest(run, cache_dir)[0]


def load_latest_sharded(run: Run, model, optimizer, cache_dir: str):
    """The newest checkpoint (either format) loaded into a sharded model on every rank, or None."""
    return resume.load_latest(run, model, optimizer, cache_dir, sharded=True)[0]
