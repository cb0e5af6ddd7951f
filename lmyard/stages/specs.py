"""What a launcher hands a stage: its spec (`exchange/spec.json`, or LMYARD_SPEC in a container)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field

from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.stages.exchange import Contract
from lmyard.stages.results import EvalResult, ExportResult, Progress, ShardProgress, ShardResult, TrainResult
from lmyard.tracking.lease import LeaseRef
from lmyard.tracking.lineage import LineageRef


class StageSpec(Contract):
    """What every stage gets: the run config. `stage` names it on the command line
    (`python -m lmyard.dispatch STAGE --spec spec.json`); `result` is the type it writes to result.json."""

    stage: ClassVar[str]
    result: ClassVar[type[BaseModel]]
    progress: ClassVar[type[BaseModel]] = Progress  # what progress.json holds, if the stage writes it
    config: RunConfig

    def nodes(self) -> int:
        """How many nodes (containers, torchrun agents) the stage runs on; every stage but training: one."""
        return 1


class ShardSpec(StageSpec):
    """Tokenize-and-shard config.data into config.store (or reuse the shard set at its address)."""

    stage: ClassVar[str] = "shard"
    result: ClassVar[type[BaseModel]] = ShardResult
    progress: ClassVar[type[BaseModel]] = ShardProgress


class TrainSpec(StageSpec):
    """Everything a rank needs: the run config, the shard set, the lineage, and who applies retention."""

    stage: ClassVar[str] = "train"
    result: ClassVar[type[BaseModel]] = TrainResult
    shards: ShardSet
    lineage: LineageRef | None = None
    lease: LeaseRef | None = Field(None, description="The flow's lease of the lineage; None: nothing is fenced.")
    hold_for_eval: bool = Field(False, description="The flow evaluates every checkpoint and applies retention.")

    def nodes(self) -> int:
        return self.config.launch.nnodes


class EvalSpec(StageSpec):
    """Score checkpoint `step` of config.run_name (None: its newest complete one) on the shard set's val split."""

    stage: ClassVar[str] = "evaluate"
    result: ClassVar[type[BaseModel]] = EvalResult
    shards: ShardSet
    step: int | None = None


class ExportSpec(StageSpec):
    """The checkpoint `source` (STORE/runs/RUN[/checkpoints/step_N], `step`) as a Hugging Face folder at `dest`."""

    stage: ClassVar[str] = "export"
    result: ClassVar[type[BaseModel]] = ExportResult
    source: str
    step: int | None = None
    dest: str = Field(description="A new (or empty) local folder or s3:// prefix.")
