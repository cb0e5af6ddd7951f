"""Checkpoint-to-store as a stage of its own in the flow's timeline: verify what landed, and record it.

A checkpoint is recorded once per lineage: a task retry, or a rerun of the lineage that meets a checkpoint an
earlier attempt recorded, logs nothing again. A checkpoint is its step *and* its commit time
(from its manifest, kept in the run's bookkeeping artifact, lmyard.tracking.bookkeeping): a step trained again after a fallback (the damaged checkpoint
moved to runs/<run>/damaged/) is another checkpoint, recorded at the same step.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from lmyard.checkpoint import catalog
from lmyard.config import RunConfig
from lmyard.run import Run
from lmyard.tracking import bookkeeping
from lmyard.tracking.lineage import Lineage
from tasks._common import artifact_key
from tasks.results import CheckpointReport


@task(
    name="checkpoint", cache_policy=NO_CACHE, task_run_name="checkpoint-step-{step}", retries=2, retry_delay_seconds=5
)
def record_checkpoint(config: RunConfig, lineage: Lineage, step: int) -> CheckpointReport:
    """Verify checkpoint `step` against its manifest in the store; its place, size and upload time to
    MLflow (system/checkpoint/* at its step) and to a Prefect artifact. The upload itself ran on the training node."""
    report = CheckpointReport.model_validate(catalog.verify(Run.of(config), step))
    if _recorded(lineage, report):
        get_run_logger().info(f"checkpoint step {step} was recorded by an earlier attempt; not logged again")
        return report
    metrics: dict[str, float] = {"system/checkpoint/bytes": report.bytes}
    if report.serialize_s is not None:
        metrics["system/checkpoint/serialize_s"] = report.serialize_s
    if report.upload_s is not None:
        metrics["system/checkpoint/upload_s"] = report.upload_s
    if report.committed is not None:  # which checkpoint of this step (see the module doc): no metric, no tag
        bookkeeping.update(lineage, step, recorded=report.committed)
    lineage.log_metrics(metrics, step)  # one batch: all of them or none; after the bookkeeping
    lineage.set_tags({"lmyard.latest_checkpoint": report.uri})
    create_table_artifact(
        key=artifact_key(config.run_name, f"checkpoint-step-{step:08d}"),
        table=[{"what": k, "value": str(v)} for k, v in report.model_dump().items()],
        description=f"Checkpoint {step} of {config.run_name} in the store",
    )
    get_run_logger().info(
        f"checkpoint step {step}: {report.bytes / 2**20:,.1f} MiB in {report.files} files at "
        f"{report.uri} (uploaded in {report.upload_s} s)"
    )
    return report


def _recorded(lineage: Lineage, report: CheckpointReport) -> bool:
    """Whether this checkpoint's metrics are on the lineage's run already: its step has system/checkpoint/bytes and,
    when its manifest has a commit time, the bookkeeping holds that time at its step."""
    history = lineage.client.get_metric_history
    if all(m.step != report.step for m in history(lineage.ref.mlflow_run_id, "system/checkpoint/bytes")):
        return False
    committed = set(bookkeeping.recorded(lineage, report.step))
    return report.committed is None or not committed or report.committed in committed
