"""Open and close the lineage's one MLflow run."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from lmyard import checkpoint, tracking
from lmyard.config import RunConfig
from lmyard.shards import ShardSet
from lmyard.store import open_store
from lmyard.version import code_version
from tasks._common import not_a_user_error


@task(name="open-lineage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=not_a_user_error)
def open_lineage(config: RunConfig, shards: ShardSet) -> tracking.Lineage:
    """Create or reopen the MLflow run of runs/<run_name> and record this attempt."""
    store = open_store(config.store)
    steps = checkpoint.complete_steps(store, config.run_name)
    resumed_from = store.uri(checkpoint.step_prefix(config.run_name, steps[-1])) if steps else None
    lineage = tracking.open_lineage(
        config, store,
        attempt_info={"flow_run_id": flow_run.get_id() or "", "flow_run_count": flow_run.get_run_count(),
                      "nodes": config.launch.nnodes, "world_size": config.world_size()},
        resumed_from=resumed_from, start_step=steps[-1] if steps else 0,
        shard_address=shards.address, code_version=code_version())
    get_run_logger().info(
        f"lineage {config.run_name}: MLflow run {lineage.mlflow_run_id}, attempt {lineage.attempt}"
        + (f", resuming from {resumed_from}" if resumed_from else ", starting fresh"))
    return lineage


@task(name="close-lineage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def close_lineage(lineage: tracking.Lineage, status: str) -> None:
    """Mark the lineage's MLflow run FINISHED, FAILED or KILLED."""
    tracking.close_lineage(lineage, status)
