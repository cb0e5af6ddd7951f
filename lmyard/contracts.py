"""What crosses a process or container boundary, as typed files.

A launcher hands each stage a spec and reads back files the stage writes
atomically into its exchange folder (`LMYARD_EXCHANGE_DIR`; in a container a
folder inside it, read back through the engine). Nothing is parsed from log
lines: the log is for people.

    exchange/spec.json          TrainSpec          the launcher -> every rank
    exchange/started.json       Started            rank 0, once resumed (what it actually loaded)
    exchange/progress.json      Progress           rank 0, replaced at every log step
    exchange/heartbeat/rank-R   step number        every rank, at every step (the watchdog's input)
    exchange/result.json        TrainResult        rank 0, last: how the stage ended and its exit code

The checkpoint's `state.json` is a `CheckpointState`: the trainer's own
state and the checkpoint schema are one type. `EvalResult` is what
`python -m lmyard.evaluate` writes, `ShardResult` what `python -m lmyard.stages shard` writes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from lmyard.errors import STATUS, ExitCode, Status

EXCHANGE_ENV = "LMYARD_EXCHANGE_DIR"
M = TypeVar("M", bound=BaseModel)


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainSpec(_Contract):
    """Everything a rank needs: the run config, the shard set, the lineage, and who applies retention."""

    config: dict[str, Any]
    shards: dict[str, Any]
    lineage: dict[str, Any] | None = None
    hold_for_eval: bool = Field(False, description="The flow evaluates every checkpoint and applies retention.")


class Started(_Contract):
    """What the trainer resumed from: the checkpoint it actually loaded (after any fallback), or none."""

    start_step: int
    resumed_from: str | None = None
    skipped_damaged: list[str] = Field(default_factory=list)
    world_size: int


class Progress(_Contract):
    step: int
    max_steps: int
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    time: float = Field(default_factory=time.time)


class TrainResult(_Contract):
    """How a training job ended. `exit_code` follows lmyard.errors.ExitCode."""

    status: Status
    exit_code: int
    message: str | None = None
    step: int = 0
    tokens_seen: int = 0
    val_loss: float | None = None
    train_loss: float | None = None
    rollbacks: int = 0
    start_step: int = 0
    resumed_from: str | None = None
    last_checkpoint: str | None = None

    @classmethod
    def ended(cls, code: ExitCode, message: str | None = None, **fields) -> TrainResult:
        return cls(status=STATUS[code], exit_code=int(code), message=message, **fields)


class CheckpointState(_Contract):
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


class EvalResult(_Contract):
    step: int
    checkpoint: str
    tokens_seen: int
    trainer_val_loss: float | None = None
    device: str
    val_loss: float
    hellaswag: dict[str, Any] | None = None
    harness: dict[str, Any] | None = Field(None, description="eval.harness_tasks: lm-eval's {metrics, results}.")
    samples: list[dict[str, str]] = Field(default_factory=list)
    eval_s: float = 0.0


class ShardResult(_Contract):
    address: str
    uri: str
    reused: bool
    train_tokens: int
    val_tokens: int


class ExportResult(_Contract):
    """What `python -m lmyard.export` writes: the export's lmyard_export.json fields and where the folder went."""

    model_config = ConfigDict(extra="allow")
    uri: str


class StageError(_Contract):
    """What a stage other than the trainer writes when it fails: its exit code and one-line message."""

    status: Status
    exit_code: int
    message: str


# ---------------------------------------------------------------- files


def write_json(path: str, data: BaseModel | dict | list) -> None:
    """Write JSON atomically (a temp file in the same folder, then rename), readable by other users."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_model(path: str, cls: type[M]) -> M | None:
    """The contract in a file, or None when the file does not exist (yet)."""
    try:
        with open(path) as f:
            return cls.model_validate_json(f.read())
    except FileNotFoundError:
        return None


class Exchange:
    """The paths of one launch's exchange folder (see the module docstring)."""

    def __init__(self, folder: str):
        self.folder = folder

    @classmethod
    def from_env(cls) -> Exchange | None:
        folder = os.environ.get(EXCHANGE_ENV)
        return cls(folder) if folder else None

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    @property
    def heartbeats(self) -> str:
        return self.path("heartbeat")

    def write(self, name: str, data: BaseModel | dict) -> None:
        write_json(self.path(name), data)


def run_stage(out: str, produce) -> int:
    """Run a stage's body in its process: its result (a contract) or its failure goes to `out`; the exit code."""
    import sys
    import traceback

    from lmyard.errors import exit_code_of

    try:
        result = produce()
    except Exception as e:
        code = exit_code_of(e)
        if code == ExitCode.CRASHED:
            traceback.print_exc()
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"lmyard: error: {message}", file=sys.stderr, flush=True)
        write_json(out, StageError(status=STATUS[code], exit_code=int(code), message=message))
        return int(code)
    write_json(out, result)
    return 0


def read_stage_result(out: str, cls: type[M], returncode: int, tail: str = "") -> M:
    """The result a stage process wrote to `out`, or the error its StageError (or exit code) names."""
    from lmyard.errors import StageFailed, error_for

    raw = None
    if os.path.exists(out):
        with open(out) as f:
            raw = f.read()
    if returncode == 0 and raw:
        return cls.model_validate_json(raw)
    if raw:
        failure = StageError.model_validate_json(raw)
        raise error_for(failure.exit_code, failure.message)
    raise StageFailed(f"the stage exited with code {returncode} without writing {out}; last lines:\n{tail}")
