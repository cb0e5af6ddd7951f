"""`state.json` of a checkpoint: the trainer's whole state besides tensors, as one type.

The trainer's own state and the checkpoint schema are this one type: the trainer writes it into every
checkpoint (both formats), resume, retraining, the evaluator and export read it back
(lmyard.checkpoint.catalog.read_state). Torch-free, so the flow's process reads it too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class CheckpointState(BaseModel):
    """`state.json` of a checkpoint: the trainer's whole state besides tensors."""

    model_config = ConfigDict(extra="ignore")  # older checkpoints may carry fields no longer written
    step: int
    cursor: int = Field(description="Global training sequences consumed: the whole data state.")
    tokens_seen: int
    world_size: int
    val_loss: float | None = Field(None, description="Validation loss measured at this very step, else null.")
    train_loss: float | None = None
    shard_address: str
    train_tokens: int = Field(0, description="Tokens of the train split this run read.")
    config: dict[str, Any]
    lineage: dict[str, Any] | None = None
    model: dict[str, Any] = Field(
        description="The model family (`arch`) and its config fields (lmyard.models.registry.model_spec)."
    )
    rollbacks: int = 0
