"""The lineage's one MLflow run, across attempts.

A lineage (`runs/<run_name>` in the store, see lmyard.layout) keeps the id of
its one MLflow run in `runs/<run_name>/lineage.json`; whatever resumes the
lineage reopens that run and records a new attempt (tags
`lmyard.attempt.<n>.*`: start step, resumed-from checkpoint, outcome), never a
fresh unrelated run.

Design notes: docs/tracking.md, `lmyard/tracking/lineage.py`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict

from lmyard.config import RunConfig, redact_uri
from lmyard.errors import UserError
from lmyard.run import Run
from lmyard.tracking import cost, schema
from lmyard.tracking.client import check_reachable, mlflow_client

CHECKPOINT_MODEL = "lmyard-checkpoint"  # model_type of a checkpoint's logged model
DELETED_TAG = "lmyard.checkpoint_deleted"
DAMAGED_TAG = "lmyard.checkpoint_damaged"  # its checkpoint failed its checksums and was moved aside


def _experiment_id(client, cfg: RunConfig) -> str:
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    location = None
    if cfg.tracking.uri.startswith("sqlite:///"):
        db = os.path.abspath(cfg.tracking.uri.removeprefix("sqlite:///"))
        location = "file://" + os.path.join(os.path.dirname(db), "mlartifacts")
    # the MLflow UI opens it in its model-training view (MLflow 3)
    return client.create_experiment(
        cfg.tracking.experiment, artifact_location=location, tags={"mlflow.experimentKind": "custom_model_development"}
    )


def lineage_run_id(run: Run) -> str | None:
    """The MLflow run id in runs/<run_name>/lineage.json (None: no lineage yet); a UserError naming the file and
    the fix when it does not parse, so a damaged file never blocks the lineage with a traceback."""
    store, key = run.store, run.layout.lineage
    if not store.exists(key):
        return None
    try:
        run_id = json.loads(store.read_bytes(key))["mlflow_run_id"]
        if not isinstance(run_id, str) or not run_id:
            raise TypeError("mlflow_run_id is not an id")
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UserError(
            f"lineage file {store.uri(key)} is corrupt ({type(e).__name__}: {str(e).splitlines()[0][:80]}); "
            'write back {"mlflow_run_id": "<the run id>"} from the MLflow UI, or delete it to record the lineage '
            "in a new MLflow run (its checkpoints are kept)"
        ) from None
    return run_id


class LineageRef(BaseModel):
    """The ids of a training lineage's MLflow run and its current attempt, as they travel to the ranks
    (lmyard.stages.TrainSpec); `Lineage` is the flow's handle on them, with its MLflow client."""

    model_config = ConfigDict(extra="forbid", frozen=True)
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


@dataclass(frozen=True)
class Lineage:
    """The MLflow run of one lineage and its current attempt (`ref`); `client` is its one MlflowClient."""

    ref: LineageRef

    @cached_property
    def client(self):
        return mlflow_client(self.ref.tracking_uri)

    def to_dict(self) -> dict:
        return self.ref.to_dict()

    @classmethod
    def from_dict(cls, d: dict) -> Lineage:
        return cls(LineageRef.from_dict(d))

    def __getstate__(self) -> dict:  # the ids travel, the client does not
        return {"ref": self.ref}

    def _with(self, client, **changes) -> Lineage:
        out = replace(self, ref=self.ref.model_copy(update=changes))
        out.__dict__["client"] = client  # the copy keeps the same client
        return out

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def open(cls, cfg: RunConfig, run: Run, *, shard_address: str, code_version: str) -> Lineage:
        """Create the lineage's MLflow run (params: the whole config), or reopen it (status RUNNING again).

        Attempts are recorded by `record_attempt`, once per launch of the trainer.
        """
        check_reachable(cfg.tracking.uri)
        client = mlflow_client(cfg.tracking.uri)
        run_id, changed, params = lineage_run_id(run), {}, cfg.flat()
        if run_id is not None:
            try:
                tracked = client.get_run(run_id)
            except Exception:
                raise UserError(
                    f"lineage {cfg.run_name!r} belongs to MLflow run {run_id}, which "
                    f"{redact_uri(cfg.tracking.uri)} does not hold: point tracking.uri at the server that has it, "
                    "or choose a new run_name"
                ) from None
            experiment_id = tracked.info.experiment_id
            attempts = int(tracked.data.tags.get("lmyard.attempts", "0"))
            changed = {k: v for k, v in params.items() if k in tracked.data.params and tracked.data.params[k] != v}
            client.update_run(run_id, status="RUNNING")
        else:
            experiment_id, run_id, attempts = *_create_run(client, cfg, run, params), 0
        lineage = cls(_ref(cfg.run_name, cfg.tracking.uri, experiment_id, run_id, attempts))
        lineage.__dict__["client"] = client
        tags = {
            "lmyard.shard_address": shard_address,
            "lmyard.code_version": code_version,
            "lmyard.store": run.uri(run.layout.root),
        }
        if cfg.tracking.parent_run_id:  # a trial of a sweep: nested under the sweep's run in the MLflow UI
            tags["mlflow.parentRunId"] = cfg.tracking.parent_run_id
        if changed:
            tags[f"lmyard.attempt.{attempts + 1}.config_changes"] = json.dumps(changed)[:5000]
        lineage.set_tags(tags)
        return lineage

    @classmethod
    def find(cls, tracking_uri: str, run: Run) -> Lineage | None:
        """The lineage of `run` (runs/<run_name>) as it stands (found through the store), without reopening its
        MLflow run; None when the store has no such lineage."""
        run_id, run_name = lineage_run_id(run), run.name
        if run_id is None:
            return None
        client = mlflow_client(tracking_uri)
        tracked = client.get_run(run_id)
        attempt = int(tracked.data.tags.get("lmyard.attempts", "0"))
        lineage = cls(_ref(run_name, tracking_uri, tracked.info.experiment_id, run_id, attempt))
        lineage.__dict__["client"] = client
        return lineage

    def record_attempt(self, *, resumed_from: str | None, start_step: int, info: dict) -> Lineage:
        """Record a new attempt on the lineage's run (number, start step, resumed-from checkpoint, `info`)."""
        run = self.client.get_run(self.ref.mlflow_run_id)
        attempt = int(run.data.tags.get("lmyard.attempts", "0")) + 1
        if run.info.status != "RUNNING":
            self.client.update_run(self.ref.mlflow_run_id, status="RUNNING")
        tags = {
            "lmyard.attempts": str(attempt),
            f"lmyard.attempt.{attempt}.start_step": str(start_step),
            f"lmyard.attempt.{attempt}.resumed_from": resumed_from or "",
            f"lmyard.attempt.{attempt}.started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            f"lmyard.attempt.{attempt}.started_at": f"{time.time():.3f}",  # its wall-clock: lmyard.tracking.cost
        }
        tags.update({f"lmyard.attempt.{attempt}.{k}": str(v) for k, v in info.items()})
        self.set_tags(tags)
        return self._with(self.client, attempt=attempt, resumed_from=resumed_from, start_step=start_step)

    def record_resume(
        self,
        *,
        resumed_from: str | None,
        start_step: int,
        gpus_per_node: int | None = None,
        hosts: list[str] | None = None,
    ) -> None:
        """Record on the current attempt the checkpoint the trainer actually loaded (reported by the trainer), the
        GPUs per node it found (lmyard.tracking.cost) and, where the backend placed the nodes (Ray), their hosts."""
        tags = {
            f"lmyard.attempt.{self.ref.attempt}.start_step": str(start_step),
            f"lmyard.attempt.{self.ref.attempt}.resumed_from": resumed_from or "",
        }
        if gpus_per_node is not None:
            tags[f"lmyard.attempt.{self.ref.attempt}.gpus_per_node"] = str(gpus_per_node)
        if hosts:
            tags[f"lmyard.attempt.{self.ref.attempt}.hosts"] = ", ".join(hosts)
        self.set_tags(tags)

    def end_attempt(self, outcome: str, detail: str = "") -> None:
        """Record how the lineage's current attempt ended (`finished`, `failed: ...`), its wall-clock and hours, and
        the lineage's GPU-hours and node-hours so far as metrics (lmyard.tracking.cost)."""
        n, attempts = self.ref.attempt, self.attempts()
        usage = cost.ended(attempts[n - 1]) if 0 < n <= len(attempts) else {}
        tags = {f"lmyard.attempt.{n}.{k}": v for k, v in usage.items()}
        tags[f"lmyard.attempt.{n}.outcome"] = (outcome + (f": {detail}" if detail else ""))[:5000]
        self.set_tags(tags)
        if usage:
            attempts[n - 1].update(usage)
            self.log_metrics(cost.of_lineage(attempts).metrics(), step=n)

    def attempts(self) -> list[dict]:
        """The recorded attempts of the lineage's run, oldest first."""
        tags = self.client.get_run(self.ref.mlflow_run_id).data.tags
        out = []
        for n in range(1, int(tags.get("lmyard.attempts", "0")) + 1):
            prefix = f"lmyard.attempt.{n}."
            out.append({"attempt": n, **{k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)}})
        return out

    def close(self, status: str) -> None:
        """Mark the lineage's MLflow run FINISHED, FAILED or KILLED."""
        self.client.set_terminated(self.ref.mlflow_run_id, status=status)

    def close_if_running(self, status: str) -> bool:
        """Mark the run `status` if it is still RUNNING; whether it was."""
        if self.client.get_run(self.ref.mlflow_run_id).info.status != "RUNNING":
            return False
        self.close(status)
        return True

    # ------------------------------------------------------------ tags, metrics, artifacts

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.ref.mlflow_run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int, model_id: str | None = None) -> None:
        """Log metrics at `step` now, in one batch (for evaluations; the trainer uses its sink); with
        `model_id`, linked to that logged model too."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(k, float(v), now, step, model_id=model_id) for k, v in metrics.items()]
        self.client.log_batch(self.ref.mlflow_run_id, metrics=points)

    def metric_history(self, key: str) -> dict[int, float]:
        """step -> value of one metric of the lineage's run."""
        return {m.step: m.value for m in self.client.get_metric_history(self.ref.mlflow_run_id, key)}

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.ref.mlflow_run_id, text, artifact_file)

    def log_dict(self, data: dict | list, artifact_file: str) -> None:
        self.client.log_dict(self.ref.mlflow_run_id, data, artifact_file)

    def log_table(self, columns: dict[str, Any], artifact_file: str) -> None:
        """Append rows (given as columns) to a table artifact the MLflow UI renders (e.g. evals/checkpoints.json)."""
        self.client.log_table(self.ref.mlflow_run_id, data=columns, artifact_file=artifact_file)

    def log_loss_curve(self, keys: tuple[str, ...] = schema.LOSSES) -> dict:
        """A PNG of the loss metrics against step, logged as plots/loss.png; returns the histories plotted."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        histories = {k: self.metric_history(k) for k in keys}
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        for key, h in histories.items():
            if h:
                steps = sorted(h)
                ax.plot(steps, [h[s] for s in steps], marker="o" if len(steps) < 30 else None, label=key)
        for a in self.attempts()[1:]:
            if a.get("start_step"):
                ax.axvline(int(a["start_step"]), color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(f"{self.ref.run_name}: loss (dotted: resumed attempts)")
        ax.legend()
        fig.tight_layout()
        self.client.log_figure(self.ref.mlflow_run_id, fig, "plots/loss.png")
        plt.close(fig)
        return histories

    def log_shard_dataset(self, shards) -> None:
        """The shard set as the run's training dataset input: name, content address (digest), store URI (source)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        m = shards.manifest
        profile = {
            "address": shards.address,
            "train_tokens": shards.tokens("train"),
            "val_tokens": shards.tokens("val"),
            "shards": len(m.get("shards", [])),
            "tokenizer": m.get("tokenizer", {}).get("name"),
        }
        dataset = Dataset(
            name=f"shards-{shards.address[:12]}",
            digest=shards.address[:36],  # MLflow keeps 36 characters
            source_type="s3" if shards.uri.startswith("s3://") else "local",
            source=json.dumps({"uri": shards.uri}),
            profile=json.dumps(profile),
            schema=json.dumps({"format": "llm.c .bin token shards", "n_vocab": m.get("tokenizer", {}).get("n_vocab")}),
        )
        context = [InputTag("mlflow.data.context", "training")]
        self.client.log_inputs(self.ref.mlflow_run_id, datasets=[DatasetInput(dataset, tags=context)])

    # ------------------------------------------------------------ the checkpoints' logged models

    def log_checkpoint_model(self, step: int, checkpoint_uri: str, descriptor: dict) -> str:
        """An MLflow logged model for one evaluated checkpoint: a descriptor that points at the checkpoint by URI
        (no weights are copied), an output of the run at `step`. Its id: log the step's metrics with it."""
        import tempfile

        from mlflow.entities import LoggedModelOutput

        model = self.client.create_logged_model(
            self.ref.experiment_id,
            name=f"{self.ref.run_name}-step-{step:08d}",
            source_run_id=self.ref.mlflow_run_id,
            model_type=CHECKPOINT_MODEL,
            params={"checkpoint_uri": checkpoint_uri, "step": str(step)},
            tags={"lmyard.run_name": self.ref.run_name, "lmyard.step": str(step)},
        )
        with tempfile.TemporaryDirectory(prefix="lmyard-model-") as tmp:
            with open(os.path.join(tmp, "lmyard_checkpoint.json"), "w") as f:
                json.dump(descriptor, f, indent=1)
            self.client.log_model_artifacts(model.model_id, tmp)
        self.client.finalize_logged_model(model.model_id, "READY")
        self.client.log_outputs(self.ref.mlflow_run_id, [LoggedModelOutput(model.model_id, step)])
        return model.model_id

    def link_metrics(
        self, model_id: str, step: int, prefixes: tuple[str, ...] = ("eval/", schema.VAL_LOSS, schema.EVAL_LOSS)
    ) -> None:
        """Link the run's metrics at `step` (those under `prefixes`) to a logged model, as MLflow's log_model does:
        the same points again with the model's id; the run's own history keeps one point per step."""
        from mlflow.entities import Metric

        run_id = self.ref.mlflow_run_id
        keys = [k for k in self.client.get_run(run_id).data.metrics if k.startswith(prefixes)]
        points = [
            Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=run_id)
            for k in keys
            for m in self.client.get_metric_history(run_id, k)
            if m.step == step and m.model_id is None
        ]
        if points:
            self.client.log_batch(run_id, metrics=points)

    def retire_checkpoint_models(
        self, steps: list[int], tag: str = DELETED_TAG, reason: str = "deleted by checkpoint retention"
    ) -> list[str]:
        """The logged models of checkpoints retention deleted (`steps`) end FAILED, their tag
        `lmyard.checkpoint_deleted` (`tag`: DAMAGED_TAG for checkpoints moved aside as damaged) and their
        description saying why (`reason`): the MLflow UI then neither lists them as ready nor offers to register
        them. Their metrics stay linked. Returns the ids of the models marked."""
        from mlflow.entities import LoggedModelStatus

        if not steps:
            return []
        wanted = {str(s) for s in steps}
        marked = []
        for model in self._checkpoint_models():
            if model.tags.get("lmyard.step") in wanted and tag not in model.tags:
                note = f"Marked FAILED: its checkpoint was {reason}; its metrics stay linked."
                self.client.set_logged_model_tags(model.model_id, {tag: reason, "mlflow.note.content": note})
                self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
                marked.append(model.model_id)
        return marked

    def _checkpoint_models(self) -> list:
        """The checkpoints' logged models of this lineage, every page."""
        out, token = [], None
        query = f"tags.`lmyard.run_name` = '{self.ref.run_name}'"
        while True:
            page = self.client.search_logged_models(
                [self.ref.experiment_id], filter_string=query, max_results=100, page_token=token
            )
            out += [m for m in page if m.model_type == CHECKPOINT_MODEL]
            token = page.token
            if not token:
                return out


def _ref(run_name: str, tracking_uri: str, experiment_id: str, run_id: str, attempt: int) -> LineageRef:
    return LineageRef(
        run_name=run_name,
        tracking_uri=tracking_uri,
        experiment_id=experiment_id,
        mlflow_run_id=run_id,
        attempt=attempt,
        resumed_from=None,
        start_step=0,
    )


def _create_run(client, cfg: RunConfig, run: Run, params: dict[str, str]) -> tuple[str, str]:
    """A new MLflow run for lineage `cfg.run_name`, its params the whole (redacted) config, its id saved in
    runs/<run_name>/lineage.json; (experiment id, run id)."""
    from mlflow.entities import Param

    experiment_id = _experiment_id(client, cfg)
    run_id = client.create_run(experiment_id, run_name=cfg.run_name, tags={"lmyard.run_name": cfg.run_name}).info.run_id
    items = [Param(k, v[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])
    saved = {"mlflow_run_id": run_id, "experiment_id": experiment_id, "tracking_uri": redact_uri(cfg.tracking.uri)}
    run.store.write_bytes(run.layout.lineage, json.dumps(saved).encode())
    return experiment_id, run_id
