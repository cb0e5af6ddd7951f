"""What an operator asks of a store: its lineages (`lmyard runs`) and the state of one (`lmyard status RUN`).

Both read what lmyard itself wrote: the store's `runs/<run>/` folders (complete checkpoints, the lease, the
lineage's MLflow run id) and, for one lineage, its MLflow run (attempts, last evaluation, registered versions).
Nothing here writes. The types are what `--json` prints.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from pydantic import BaseModel

from lmyard.checkpoint import catalog
from lmyard.config import redact_uri
from lmyard.errors import UserError
from lmyard.layout import RUNS
from lmyard.run import Run
from lmyard.store import Store
from lmyard.tracking import cost, lease, schema
from lmyard.tracking.client import mlflow_client, tracking_errors
from lmyard.tracking.lineage import lineage_run_id


class LeaseHolder(BaseModel):
    holder: str  # host, pid, flow run, since
    heartbeat_age_s: float
    expired: bool  # a run started now would take it over


class RunRow(BaseModel):
    """One lineage of the store, from the store alone."""

    run_name: str
    checkpoints: int  # complete ones
    newest_step: int | None
    newest_checkpoint: str | None  # its URI
    lease: LeaseHolder | None  # None: no run holds the lineage
    mlflow_run_id: str | None


class Attempt(BaseModel):
    number: int
    start_step: int | None
    resumed_from: str | None
    outcome: str | None  # None while it runs (or when it died without a word)
    nodes: int | None = None  # the nodes it trained on
    hosts: str | None = None  # their hosts
    resized: str | None = None  # why it has another size than the attempt before (lmyard.launch.elastic)
    steps: int | None = None  # committed steps it trained: the next attempt's start step less its own
    gpus_per_node: int | None = None
    wall_s: float | None = None  # None until it ends (lmyard.tracking.cost)
    node_hours: float | None = None
    gpu_hours: float | None = None
    flow_run_url: str | None = None  # its flow run's page in the Prefect UI, where the API has one
    restart_s: dict[str, float] = {}  # its launch to its first step, in parts (system/restart/*; total included)


class Goodput(BaseModel):
    """The lineage's goodput so far (system/goodput/*, lmyard.train.components.Goodput)."""

    goodput: float  # productive / wall
    wall_s: float  # the attempts' time, launch to last record, summed
    productive_s: float  # in steps whose results survive
    badput_s: dict[str, float]  # by cause: start, restart, steps_lost, checkpoint, evaluation


class LastEvaluation(BaseModel):
    step: int
    val_loss: float
    rows: dict[str, str] = {}  # every evaluation's, what -> value (its logged EvalResult's: lmyard.stages)


class ModelVersion(BaseModel):
    name: str
    version: str
    aliases: list[str]
    uri: str  # models:/NAME/VERSION


class RunStatus(RunRow):
    """One lineage: the store's view and its MLflow run's."""

    tokens_seen: int | None  # at the newest complete checkpoint
    newest_damaged: str | None  # what is wrong with the newest complete checkpoint's files (None: nothing found)
    damaged_steps: list[int]  # steps whose checkpoint was moved aside as damaged (runs/RUN/damaged/)
    mlflow_status: str | None  # RUNNING, FINISHED, FAILED, KILLED
    mlflow_run_url: str | None  # the run's page in the MLflow UI (a local store's: once `mlflow ui` serves it)
    flow_run_url: str | None = None  # the newest attempt's flow run in the Prefect UI, where the API has one
    attempts: list[Attempt]
    usage: cost.Usage | None = None  # the attempts' GPU-hours and node-hours, summed
    goodput: Goodput | None
    last_evaluation: LastEvaluation | None
    registered_versions: list[ModelVersion]


def check_store(store: Store) -> None:
    """UserError when the store is not there: a local folder that does not exist, a bucket that does not (an
    unreachable S3 endpoint is one line too: lmyard.store.s3_errors)."""
    local = store.local_path("")
    if local is not None and not os.path.isdir(local):
        raise UserError(
            f"store {local} does not exist: give --store (or LMYARD_STORE) the store the lineages were written to"
        )
    store.exists(RUNS)


def run_names(store: Store) -> list[str]:
    """Names of the lineages in the store (folders under runs/ that hold a lineage, a lease or checkpoints)."""
    names = set()
    for key in store.list(f"{RUNS}/"):
        parts = key.split("/")
        if len(parts) >= 3 and parts[0] == RUNS:
            names.add(parts[1])
    return sorted(names)


def _lease(run: Run) -> LeaseHolder | None:
    store, key = run.store, run.layout.lease
    if not store.exists(key):
        return None
    record = lease.parse(store.read_bytes(key), store.uri(key))
    now = time.time()
    return LeaseHolder(
        holder=lease.describe(record),
        heartbeat_age_s=round(now - float(record.get("heartbeat", 0)), 1),
        expired=lease.expired(record, now),
    )


def run_row(run: Run) -> RunRow:
    steps = catalog.complete_steps(run)
    return RunRow(
        run_name=run.name,
        checkpoints=len(steps),
        newest_step=steps[-1] if steps else None,
        newest_checkpoint=run.uri(run.layout.step(steps[-1])) if steps else None,
        lease=_lease(run),
        mlflow_run_id=lineage_run_id(run),
    )


def list_runs(store: Store) -> list[RunRow]:
    return [run_row(Run(name, store)) for name in run_names(store)]


def _attempts(tags: dict[str, str]) -> list[Attempt]:
    def tag(n: int, key: str) -> str | None:
        return tags.get(f"lmyard.attempt.{n}.{key}") or None

    def number(n: int, key: str, kind=float):
        try:
            return kind(float(v)) if (v := tag(n, key)) is not None else None
        except ValueError:
            return None

    attempts = [
        Attempt(
            number=n,
            start_step=int(s) if (s := tag(n, "start_step")) is not None else None,
            resumed_from=tag(n, "resumed_from"),
            outcome=tag(n, "outcome"),
            nodes=int(k) if (k := tag(n, "nodes")) and k.isdigit() else None,
            hosts=tag(n, "hosts"),
            resized=tag(n, "resized"),
            gpus_per_node=number(n, "gpus_per_node", int),
            wall_s=number(n, "wall_s"),
            node_hours=number(n, "node_hours"),
            gpu_hours=number(n, "gpu_hours"),
            flow_run_url=tag(n, "flow_run_url"),
        )
        for n in range(1, int(tags.get("lmyard.attempts", "0")) + 1)
    ]
    for a, after in zip(attempts, attempts[1:]):
        if a.start_step is not None and after.start_step is not None:
            a.steps = after.start_step - a.start_step
    return attempts


def _usage(tags: dict[str, str]) -> cost.Usage:
    """The lineage's usage from its attempts' tags (lmyard.tracking.cost)."""
    attempts = [
        {k.removeprefix(f"lmyard.attempt.{n}."): v for k, v in tags.items() if k.startswith(f"lmyard.attempt.{n}.")}
        for n in range(1, int(tags.get("lmyard.attempts", "0")) + 1)
    ]
    return cost.of_lineage(attempts)


def _with_restarts(attempts: list[Attempt], client, run_id: str, metrics: dict[str, float]) -> list[Attempt]:
    """Each attempt's restart parts: the system/restart/* points at its first step (start_step + 1), oldest first
    when several attempts started from the same step."""
    keys = [k for k in metrics if k.startswith(schema.RESTART_METRICS)]
    points: dict[int, list[dict[str, float]]] = {}  # first step -> one dict per attempt, in time order
    for key in keys:
        part = key.removeprefix(schema.RESTART_METRICS).removesuffix("_s")
        by_step: dict[int, int] = {}
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            i = by_step[m.step] = by_step.get(m.step, -1) + 1
            rows = points.setdefault(m.step, [])
            rows.extend({} for _ in range(i + 1 - len(rows)))
            rows[i][part] = round(m.value, 3)
    for a in attempts:
        waiting = points.get((a.start_step or 0) + 1, [])
        if waiting:
            a.restart_s = waiting.pop(0)
    return attempts


def _goodput(metrics: dict[str, float]) -> Goodput | None:
    g = {k.removeprefix(schema.GOODPUT_METRICS): v for k, v in metrics.items() if k.startswith(schema.GOODPUT_METRICS)}
    if "goodput" not in g:
        return None
    badput = {
        k.removeprefix("badput/").removesuffix("_s"): round(v, 3) for k, v in g.items() if k.startswith("badput/")
    }
    return Goodput(
        goodput=round(g["goodput"], 4),
        wall_s=round(g.get("wall_s", 0.0), 3),
        productive_s=round(g.get("productive_s", 0.0), 3),
        badput_s=badput,
    )


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui --backend-store-uri <a local store>` serves its pages


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI of a tracking URI: the server's own for http(s); for a local store (sqlite, a folder), the
    address at which `mlflow ui --backend-store-uri URI` serves it (lmyard.console.where_next prints that command)."""
    uri = tracking_uri.rstrip("/")
    return redact_uri(uri) if uri.startswith(("http://", "https://")) else LOCAL_UI


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI (see ui_base)."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}"  # not a store key: the UI page


def version_url(tracking_uri: str, name: str, version: str) -> str:
    """A registered model version's page in the MLflow UI (see ui_base)."""
    return f"{ui_base(tracking_uri)}/#/models/{name}/versions/{version}"


def _evaluation_rows(client, run_id: str, step: int) -> dict[str, str]:
    """How the evaluation logged at `step` reads (its EvalResult's scores' rows, in order); {} without its file."""
    key = schema.EVAL_RESULT.format(step)
    if key not in {a.path for a in client.list_artifacts(run_id, os.path.dirname(key))}:
        return {}
    with tempfile.TemporaryDirectory(prefix="lmyard-status-") as tmp:
        with open(client.download_artifacts(run_id, key, tmp)) as f:
            scores = json.load(f).get("scores") or {}
    return {what: value for score in scores.values() for what, value in score.get("rows", {}).items()}


def checkpoint_damage(run: Run, step: int, checksums: bool = False) -> str | None:
    """What is wrong with checkpoint `step`'s files against its manifest: their sizes (one listing call a file),
    and with `checksums` their SHA-256 (reads every byte); None when nothing is."""
    from lmyard.checkpoint.manifest import mismatch

    try:
        catalog.verify(run, step)
        catalog.read_state(run, step)
        if checksums:
            for name, meta in catalog.read_manifest(run, step).files.items():
                key = run.layout.step_file(step, name)
                if run.store.sha256(key) != meta.sha256:
                    raise mismatch(run.uri(key))
    except ValueError as e:  # DamagedCheckpoint and pydantic's ValidationError are ValueErrors
        return str(e).splitlines()[0]
    return None


def run_status(run: Run, tracking_uri: str, checksums: bool = False) -> RunStatus:
    """The state of lineage `run`; UserError when the store holds no such lineage."""
    run_name, store = run.name, run.store
    if run_name not in run_names(store):
        known = ", ".join(run_names(store)) or "none"
        raise UserError(f"no lineage {run_name!r} in {store.uri(RUNS)} (lineages there: {known})")
    row = run_row(run)
    step = row.newest_step
    damage = checkpoint_damage(run, step, checksums) if step is not None else None
    tokens = catalog.read_state(run, step).tokens_seen if step is not None and not damage else None
    status = RunStatus(
        **row.model_dump(),
        tokens_seen=tokens,
        newest_damaged=damage,
        damaged_steps=sorted(catalog.damaged(run)),
        mlflow_status=None,
        mlflow_run_url=None,
        attempts=[],
        goodput=None,
        last_evaluation=None,
        registered_versions=[],
    )
    if row.mlflow_run_id is None:
        return status
    client = mlflow_client(tracking_uri)
    fix = "give --tracking-uri (or LMYARD_TRACKING__URI) the MLflow server the lineage was recorded on"
    with tracking_errors(tracking_uri, f"lineage {run_name}'s MLflow run {row.mlflow_run_id}", fix):
        tracked = client.get_run(row.mlflow_run_id)
        history = client.get_metric_history(row.mlflow_run_id, schema.EVAL_LOSS)
        versions = client.search_model_versions(f"run_id = '{row.mlflow_run_id}'")
        last = max(history, key=lambda m: m.step) if history else None
        rows = _evaluation_rows(client, row.mlflow_run_id, last.step) if last else {}
    status.mlflow_status = tracked.info.status
    status.mlflow_run_url = run_url(tracking_uri, tracked.info.experiment_id, row.mlflow_run_id)
    status.attempts = _with_restarts(_attempts(tracked.data.tags), client, row.mlflow_run_id, tracked.data.metrics)
    status.flow_run_url = next((a.flow_run_url for a in reversed(status.attempts) if a.flow_run_url), None)
    status.usage = _usage(tracked.data.tags)
    status.last_evaluation = LastEvaluation(step=last.step, val_loss=last.value, rows=rows) if last else None
    status.goodput = _goodput(tracked.data.metrics)
    status.registered_versions = [
        ModelVersion(
            name=v.name, version=str(v.version), aliases=list(v.aliases or []), uri=f"models:/{v.name}/{v.version}"
        )
        for v in sorted(versions, key=lambda v: int(v.version))
    ]
    return status


def usage_by_experiment(store: Store, rows: list[RunRow], tracking_uri: str) -> dict[str, tuple[int, cost.Usage]]:
    """Experiment name -> (lineages, their usage summed), over the lineages of `rows` that have an MLflow run."""
    client = mlflow_client(tracking_uri)
    names: dict[str, str] = {}
    out: dict[str, tuple[int, cost.Usage]] = {}
    for row in rows:
        if row.mlflow_run_id is None:
            continue
        run = client.get_run(row.mlflow_run_id)
        exp = run.info.experiment_id
        names[exp] = names.get(exp) or client.get_experiment(exp).name
        n, usage = out.get(names[exp], (0, cost.Usage()))
        out[names[exp]] = (n + 1, usage + _usage(run.data.tags))
    return out
