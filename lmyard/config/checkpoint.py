"""The `checkpoint` section: intervals, retention, uploads."""

from __future__ import annotations

from pydantic import Field

from lmyard.config.base import _Section


class CheckpointConfig(_Section):
    interval: int = Field(100, gt=0, description="Steps between checkpoints (the last step is always saved).")
    keep_last: int = Field(3, ge=2, description="Newest checkpoints kept (2 at least: the newest may still be read).")
    keep_every: int | None = Field(None, gt=0, description="Also keep every step that is a multiple of this.")
    keep_best: bool = Field(True, description="Also keep the checkpoint with the lowest validation loss.")
    max_pending: int = Field(
        2, ge=1, description="Checkpoints that may wait for an unreachable store before training stops."
    )
    upload_retries: int = Field(6, ge=0, description="Retries of a failed upload (backoff 1, 2, 4 ... 30 s).")
    files_per_rank: int = Field(
        4,
        ge=1,
        le=64,
        description="train.parallel=fsdp: files each rank writes a sharded checkpoint into (DCP writer threads); "
        "their sha256 sums are made, and on resume they are read and checked, in parallel.",
    )
