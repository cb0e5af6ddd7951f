"""Checkpoint retention in the flow: release each evaluated checkpoint, then delete what the policy drops (and
retire the logged models of the checkpoints deleted)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.checkpoint import retention
from lmyard.config import RunConfig
from lmyard.run import Run
from lmyard.tracking.lineage import Lineage


@task(
    name="retain-checkpoints",
    cache_policy=NO_CACHE,
    task_run_name="retain-after-step-{step}",
    retries=2,
    retry_delay_seconds=5,
)
def retain_checkpoints(config: RunConfig, step: int, evaluated: bool, final: bool = False) -> list[int]:
    """Mark checkpoint `step` as evaluated (or its evaluation as failed) and apply checkpoint retention.

    While training runs, checkpoints not yet evaluated are kept; `final` (after the last evaluation)
    applies the plain policy, so nothing stays held by an evaluation that never ended.
    """
    run = Run.of(config)
    retention.mark_evaluated(run, step, evaluated)
    deleted = retention.apply(run, config.checkpoint, hold_for_eval=not final)
    if deleted:
        get_run_logger().info(f"retention deleted checkpoints {deleted} of {config.run_name}")
        lineage = Lineage.find(config.tracking.uri, run)
        if lineage is not None:  # their logged models point at nothing now: the UI must not offer them
            keep = f"checkpoint.keep_last={config.checkpoint.keep_last}, checkpoint.keep_best={config.checkpoint.keep_best}"
            lineage.retire_checkpoint_models(deleted, reason=f"deleted by checkpoint retention ({keep})")
    return deleted
