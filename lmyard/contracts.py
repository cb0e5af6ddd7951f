"""What crosses a process or container boundary, as typed files.

Every stage (shard, train, evaluate, export) is a typed spec in and a typed
result out. A launcher (lmyard.launch) hands the stage its spec and reads back
files the stage writes atomically into its exchange folder
(`LMYARD_EXCHANGE_DIR`; in a container a folder inside it, read back through
the engine). Nothing is parsed from log lines: the log is for people.

    exchange/spec.json          a StageSpec        the launcher -> the stage (in a container: LMYARD_SPEC)
    exchange/started.json       Started            training's rank 0, once resumed (what it actually loaded)
    exchange/progress.json      Progress           training's rank 0, replaced at every log step
    exchange/heartbeat/rank-R   step number        every rank, at every step (the watchdog's input)
    exchange/result.json        the spec's result  last: ShardResult, TrainResult, EvalResult, ExportResult,
                                                   or the StageError of a failure (exit_code != 0)

`run_stage` is the one path from a stage's exception to its exit code and
StageError; `read_result` the one way back. The checkpoint's `state.json` is a
`CheckpointState`: the trainer's own state and the checkpoint schema are one
type. What tasks hand the flows (Evaluation, RegisteredModel, RunSummary,
RetrainDecision) are contracts too: flows read fields, never string keys.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from lmyard.config import RunConfig
from lmyard.errors import STATUS, ExitCode, NoSpace, Status, UserError, exit_code_of, status_of
from lmyard.paths import no_space

EXCHANGE_ENV = "LMYARD_EXCHANGE_DIR"
SPEC_ENV = "LMYARD_SPEC"  # the spec itself, where no file can be handed over (a container)
M = TypeVar("M", bound=BaseModel)


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardSet(_Contract):
    """A complete shard set: where it lives and what its manifest says (lmyard.data.shards has the format)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    address: str
    uri: str
    manifest: dict[str, Any]

    def files(self, split: str) -> list[dict]:
        return [s for s in self.manifest["shards"] if s["split"] == split]

    def tokens(self, split: str) -> int:
        return sum(s["tokens"] for s in self.files(split))

    @property
    def n_vocab(self) -> int:
        return int(self.manifest["tokenizer"]["n_vocab"])

    @property
    def separators(self) -> tuple[int | None, int | None]:
        """(id written before each document, id written after it), as the manifest's tokenizer records them
        (lmyard.data.tokenizer.identity): its bos/eos where set, else tiktoken's <|endoftext|> before each."""
        t = self.manifest["tokenizer"]
        if "bos" in t or "eos" in t:
            return t.get("bos"), t.get("eos")
        return t.get("eot"), None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, d: dict) -> ShardSet:
        return cls.model_validate(d)


class LineageRef(_Contract):
    """The ids of a training lineage's MLflow run and its current attempt, as they travel to the ranks
    (lmyard.tracking.lineage.Lineage, the flow's handle with its MLflow client, validates into it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, from_attributes=True)
    run_name: str
    tracking_uri: str
    experiment_id: str
    mlflow_run_id: str
    attempt: int
    resumed_from: str | None
    start_step: int

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, d: dict) -> LineageRef:
        return cls.model_validate(d)


class LeaseRef(_Contract):
    """The lineage's lease as its holder took it (lmyard.tracking.lease), as it travels to the trainer: the
    trainer's rank 0 stops, and its commits are refused, once the lease record is no longer this one."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    token: str
    epoch: int = Field(description="One more than the lease record it replaced (1 for a fresh lease).")
    ttl_s: float


# ---------------------------------------------------------------- what stages write back


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


class ShardProgress(_Contract):
    """Tokenize-and-shard's progress (lmyard.data.sharding.Progress), replaced as it goes."""

    documents: int
    tokens: int
    shards: int
    elapsed_s: float
    docs_per_s: float
    tokens_per_s: float
    fraction: float | None = None
    done: bool = False


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


class HellaSwagScore(_Contract):
    acc: float = Field(description="The ending with the lowest summed loss is right.")
    acc_norm: float = Field(description="The ending with the lowest mean loss per token is right.")
    n: int
    rows: list[dict[str, Any]] = Field(default_factory=list, description="Per example: label, preds, losses.")


class HarnessScore(_Contract):
    metrics: dict[str, float] = Field(description="lm-eval's metrics, flattened `task/metric`.")
    results: dict[str, Any] = Field(default_factory=dict)


class Sample(_Contract):
    prompt: str
    completion: str


class EvalResult(_Contract):
    step: int
    checkpoint: str
    tokens_seen: int
    trainer_val_loss: float | None = None
    device: str
    val_loss: float
    hellaswag: HellaSwagScore | None = None
    harness: HarnessScore | None = Field(None, description="eval.harness_tasks: lm-eval's {metrics, results}.")
    samples: list[Sample] = Field(default_factory=list)
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Every evaluation's metrics by MLflow name (lmyard.evaluate.registry)."
    )
    eval_s: float = 0.0


class ShardResult(_Contract):
    shards: ShardSet
    reused: bool = Field(description="The shard set was already at its address: nothing was tokenized.")
    train_tokens: int
    val_tokens: int


class ExportResult(_Contract):
    """lmyard_export.json's fields and where the folder went."""

    model_config = ConfigDict(extra="allow")  # the rest of lmyard_export.json (tokenizer, provenance)
    uri: str
    checkpoint: str
    step: int
    tokens_seen: int
    architecture: str
    hf_architecture: str


class StageError(_Contract):
    """What a stage writes when it fails: its exit code and one-line message."""

    status: Status
    exit_code: int
    message: str

    @classmethod
    def ended(cls, code: ExitCode, message: str) -> StageError:
        return cls(status=STATUS[code], exit_code=int(code), message=message)


# ---------------------------------------------------------------- what tasks return to the flows


class CheckpointReport(_Contract):
    """A checkpoint verified in the store against its manifest (lmyard.checkpoint.catalog.verify)."""

    step: int
    uri: str
    format: str = Field(description="The checkpoint's format: `full` (one state dict) or `dcp` (shards per rank).")
    files: int
    bytes: int
    serialize_s: float | None = None
    upload_s: float | None = None
    committed: float | None = Field(None, description="When the manifest was written (epoch seconds).")


class Evaluation(_Contract):
    """One checkpoint's evaluation as the flow sees it: its result, or the error that stopped it.
    A failed evaluation never fails the run (it is recorded on the MLflow run and in the RunSummary)."""

    step: int
    checkpoint: str
    result: EvalResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None


class Gate(_Contract):
    value: float | None
    limit: float
    passed: bool


class RegisteredModel(_Contract):
    """A model version in the MLflow registry: the final checkpoint exported and logged."""

    name: str
    version: str
    alias: str | None = None
    gates: dict[str, Gate] = Field(default_factory=dict)
    source: str
    model_uri: str


class RunSummary(_Contract):
    """What the pretrain flow returns (and logs as summary.json)."""

    run_name: str
    mlflow_run_id: str
    attempts: int
    shard_address: str
    steps: int
    tokens_seen: int
    train_loss: float | None = None
    val_loss: float | None = Field(None, description="The final evaluation's, else the trainer's own.")
    hellaswag_acc_norm: float | None = None
    checkpoint: str
    registered_model: str
    alias: str | None = None
    failed_evaluations: dict[int, str] = Field(default_factory=dict, description="step -> what went wrong.")


class RetrainDecision(_Contract):
    """What a scheduled retraining does: `train` from scratch, `continue` on new data, or `none`."""

    action: Literal["train", "continue", "none"]
    reason: str
    from_step: int
    max_steps: int
    run: RunSummary | None = None


# ---------------------------------------------------------------- specs: what a launcher hands a stage


class StageSpec(_Contract):
    """What every stage gets: the run config. `stage` names it on the command line
    (`python -m lmyard.stages STAGE --spec spec.json`); `result` is the type it writes to result.json."""

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


def read_spec(cls: type[M], path: str | None) -> M:
    """A stage's spec: the file `path`, else the LMYARD_SPEC environment variable (a container's)."""
    if path:
        with open(path) as f:
            return cls.model_validate_json(f.read())
    if SPEC_ENV in os.environ:
        return cls.model_validate_json(os.environ[SPEC_ENV])
    raise UserError(f"no spec: give --spec PATH or set {SPEC_ENV} (the {cls.__name__} as JSON)")


def one_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def run_stage(
    produce: Callable[[], BaseModel],
    out: str | None,
    *,
    failure_out: str | None = None,
    failed: Callable[[ExitCode, str], BaseModel] = StageError.ended,
    quiet: bool = False,
) -> int:
    """The one way a stage process ends: `produce()`'s result goes to `out`, or its failure (`failed(code,
    message)`, a StageError unless the stage says otherwise) to `failure_out` (default: `out`); returns the exit
    code (lmyard.errors.ExitCode). An unexpected error prints its traceback, a known one a single line (`quiet`:
    none, e.g. on every rank but 0, which all fail alike)."""
    import sys
    import traceback

    try:
        result = produce()
    except BaseException as e:  # KeyboardInterrupt included: SIGINT ends a stage as preempted
        error = no_space(e) or e  # a full cache disk, wherever it was hit: one line, exit 4
        code = exit_code_of(error)
        if code == ExitCode.CRASHED:
            traceback.print_exc()
        elif not quiet:
            print(f"lmyard: error: {one_line(error)}", file=sys.stderr, flush=True)
        where = failure_out or out
        if where:
            report = failed(code, one_line(error))
            if "status" in type(report).model_fields:  # NoSpace shares exit code 4 with StoreOutage
                report = report.model_copy(update={"status": status_of(error)})
            try:
                write_json(where, report)
            except OSError:
                if not isinstance(error, NoSpace):
                    raise  # on a full disk the exit code alone says it
        return int(code)
    if out:
        write_json(out, result)
    return 0


def read_result(raw: bytes | str, cls: type[M]) -> M | StageError:
    """A stage's result file: its result, or the StageError of one whose exit code is not 0 (a TrainResult of a
    failed training is one too)."""
    data = json.loads(raw)
    if data.get("exit_code", 0) != 0:
        error = StageError.ended(ExitCode(data["exit_code"]), data.get("message") or data.get("status") or "failed")
        return error.model_copy(update={"status": data["status"]}) if data.get("status") == "no_space" else error
    return cls.model_validate(data)
