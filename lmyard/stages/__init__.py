"""The stage runtime: what crosses a process or container boundary, as typed files, and how a stage ends.

Every stage (shard, train, evaluate, export) is a typed spec in and a typed result out
(`python -m lmyard.stages STAGE`, lmyard.stages.entry). A launcher (lmyard.launch) hands the stage its spec
and reads back files the stage writes atomically into its exchange folder (`LMYARD_EXCHANGE_DIR`; in a
container a folder inside it, read back through the engine). Nothing is parsed from log lines.

Design notes: docs/launch.md, `lmyard/stages/__init__.py`.
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
from lmyard.stages.runtime import (
    RANK_EXITS_ENV,
    RANK_LINE,
    RankExit,
    prefix_rank_lines,
    rank_exit,
    rank_exits,
    read_result,
    read_spec,
    run_stage,
)
from lmyard.stages.specs import EvalSpec, ExportSpec, ShardSpec, StageSpec, TrainSpec

__all__ = [
    "EXCHANGE_ENV",
    "RANK_EXITS_ENV",
    "RANK_LINE",
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
    "prefix_rank_lines",
    "rank_exit",
    "rank_exits",
    "read_beats",
    "read_model",
    "read_result",
    "read_spec",
    "run_stage",
    "write_json",
]
