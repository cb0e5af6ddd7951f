"""The stage runtime: what crosses a process or container boundary, as typed files, and how a stage ends.

Every stage (shard, train, evaluate, export) is a typed spec in and a typed result out
(`python -m lmyard.dispatch STAGE`, lmyard.dispatch). A launcher (lmyard.launch) hands the stage its spec
and reads back files the stage writes atomically into its exchange folder (`LMYARD_EXCHANGE_DIR`; in a
container a folder inside it, read back through the engine). Nothing is parsed from log lines.

    exchange/spec.json          a StageSpec        the launcher -> the stage (in a container: LMYARD_SPEC)   specs
    exchange/started.json       Started            training's rank 0, once resumed (what it actually loaded) results
    exchange/progress.json      Progress           training's rank 0, replaced at every log step             results
    exchange/heartbeat/rank-R   step number        every rank, at every step (the watchdog's input)          heartbeat
    exchange/rank-exits-*/      RankExit           a preempted training rank, for lmyard's torchrun alone    runtime
      rank-R.json                                  (rank_exit; the folder goes when torchrun ends)
    exchange/result.json        the spec's result  last: ShardResult, TrainResult, EvalResult, ExportResult,  results
                                                   or the StageError of a failure (exit_code != 0)

`run_stage` is the one path from a stage's exception to its exit code and StageError; `read_result` the one way
back (lmyard.stages.runtime). The domain types the specs carry belong to their subjects: ShardSet
(lmyard.data.shardset), LineageRef (lmyard.tracking.lineage), LeaseRef (lmyard.tracking.lease); a checkpoint's
`state.json` is lmyard.checkpoint.schema.CheckpointState.
"""

from lmyard.stages.exchange import EXCHANGE_ENV, SPEC_ENV, Contract, Exchange, read_model, write_json
from lmyard.stages.heartbeat import Heartbeat, read_beats
from lmyard.stages.results import (
    EvalResult,
    ExportResult,
    Progress,
    Sample,
    Score,
    ShardProgress,
    ShardResult,
    StageError,
    Started,
    TrainResult,
)
from lmyard.stages.runtime import RANK_EXITS_ENV, RankExit, rank_exit, rank_exits, read_result, read_spec, run_stage
from lmyard.stages.specs import EvalSpec, ExportSpec, ShardSpec, StageSpec, TrainSpec

__all__ = [
    "EXCHANGE_ENV",
    "RANK_EXITS_ENV",
    "SPEC_ENV",
    "Contract",
    "EvalResult",
    "EvalSpec",
    "Exchange",
    "ExportResult",
    "ExportSpec",
    "Heartbeat",
    "Progress",
    "RankExit",
    "Sample",
    "Score",
    "ShardProgress",
    "ShardResult",
    "ShardSpec",
    "StageError",
    "StageSpec",
    "Started",
    "TrainResult",
    "TrainSpec",
    "rank_exit",
    "rank_exits",
    "read_beats",
    "read_model",
    "read_result",
    "read_spec",
    "run_stage",
    "write_json",
]
