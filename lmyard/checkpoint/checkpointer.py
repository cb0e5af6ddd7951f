"""The trainer's one checkpointer: a `Checkpointer` of the format its model's layout implies, chosen once.

    plain (ddp)     FullCheckpointer      rank 0 saves the whole state dicts (lmyard.checkpoint.full)
    sharded (fsdp)  ShardedCheckpointer   every rank saves its shards with DCP (lmyard.checkpoint.dcp)

Both save in the background (the loop is blocked only while the state is copied
into reused pinned buffers), commit through lmyard.checkpoint.commit (files, then
the manifest; one retry policy) and load through lmyard.checkpoint.resume, which
reads either format into either kind of model (`resume.load_latest(...,
sharded=checkpointer.sharded, group=checkpointer.group)`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from lmyard.checkpoint.full import FullCheckpointer
from lmyard.config import RunConfig
from lmyard.run import Run

if TYPE_CHECKING:  # torch's DCP and DTensor cost every rank a second to import: only a sharded model's
    from lmyard.checkpoint.dcp import ShardedCheckpointer


class Checkpointer(Protocol):
    """Saves checkpoints of one lineage in the background; every rank holds one and calls it alike."""

    sharded: bool  # loads go into a sharded model (each rank its shards), else a plain one (whole state)
    blocked_s: list[float]
    error: BaseException | None  # what stopped the background writer (raised at the next save or flush)

    @property
    def group(self) -> object:
        """The process group resume agrees over (None: the default one); read-only, so any group type fits."""

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Make the copy buffers in the background (after the first step: the optimizer has its state)."""

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict, rng: list) -> float:
        """Copy the state off the device and return (seconds blocked); serialized and committed later."""

    def before_update(self) -> object:
        """Call before the optimizer changes the weights: a copy in flight finishes first."""

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every checkpoint so far is committed; StoreOutage after `timeout_s`."""

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for every checkpoint to be committed, then stop."""

    def discard(self) -> None:
        """Stop without waiting and delete this run's staging folder (the cache disk is full)."""


def make_checkpointer(
    cfg: RunConfig,
    run: Run,
    rank: int,
    *,
    sharded: bool,
    on_commit: Callable[[int, str], None] | None = None,
    fence: Callable[[], None] | None = None,
) -> Checkpointer:
    """The checkpointer for a model `sharded` over the ranks (train.parallel=fsdp, as lmyard.train.distributed.parallelism
    decided) or not; every rank makes it at the same point (a collective for DCP). `fence` runs before each
    manifest is written (lmyard.checkpoint.commit: the lineage's lease)."""
    c, staging = cfg.checkpoint, os.path.join(run.cache, "staging")
    # torch.save's CRC32 of every record is a second checksum on the save's path (a fifth of a 124M model's
    # serialisation, bench_stage.py): the manifest's sha256 covers every byte, and torch.load reads such files
    # alike. The setting is process-wide: every torch.save of a trainer rank skips it
    torch.serialization.set_crc32_options(False)
    checkpointer: ShardedCheckpointer | FullCheckpointer
    if sharded:
        from lmyard.checkpoint.dcp import ShardedCheckpointer

        checkpointer = ShardedCheckpointer(
            run,
            staging,
            write_threads=c.files_per_rank,
            max_pending=c.max_pending,
            retries=c.upload_retries,
            on_commit=on_commit,
        )
    else:
        checkpointer = FullCheckpointer(
            run,
            staging,
            rank=rank,
            max_pending=c.max_pending,
            retries=c.upload_retries,
            on_commit=on_commit,
        )
    checkpointer.policy.fence = fence  # both formats commit through the one policy
    return checkpointer
