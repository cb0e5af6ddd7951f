"""Open and close the lineage's one MLflow run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.config import RunConfig
from lmyard.data.shards import ShardSet
from lmyard.errors import LeaseLost
from lmyard.launch.follower import stop_all
from lmyard.recipes import with_recipe
from lmyard.run import Run
from lmyard.tracking import lease
from lmyard.tracking.lineage import Lineage
from lmyard.version import code_version
from tasks._common import not_a_user_error


@task(name="open-lineage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=not_a_user_error)
def open_lineage(config: RunConfig, shards: ShardSet) -> Lineage:
    """Create or reopen the MLflow run of runs/<run_name>; the train task records each attempt."""
    lineage = Lineage.open(config, Run.of(config), shard_address=shards.address, code_version=code_version())
    lineage.log_shard_dataset(shards)  # the UI's "Datasets": which data trained the run
    get_run_logger().info(
        f"lineage {config.run_name}: MLflow run {lineage.ref.mlflow_run_id}"
        + (f", {lineage.ref.attempt} earlier attempt(s)" if lineage.ref.attempt else ", new")
    )
    return lineage


@task(name="close-lineage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def close_lineage(lineage: Lineage, status: str | None) -> None:
    """Mark the lineage's MLflow run FINISHED, FAILED or KILLED; None: leave it (another run holds the lineage)."""
    if status is None:
        get_run_logger().info(f"lineage {lineage.ref.run_name}: another run holds it now; its MLflow run stays open")
        return
    lineage.close(status)


def ended_status(exc: BaseException) -> str | None:
    """The MLflow status of a run that ended with `exc`: KILLED for interrupts and cancellation, None for a lost
    lease (the lineage's MLflow run is its new holder's now), else FAILED."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, LeaseLost):
        return None
    return "KILLED" if isinstance(exc, (KeyboardInterrupt, SystemExit, TerminationSignal)) else "FAILED"


def _close_from_hook(flow_run, status: str) -> str | None:
    """Mark the MLflow run of the lineage a flow run trained (from its parameters) `status`, if still RUNNING."""
    params = flow_run.parameters or {}
    config = with_recipe(RunConfig.model_validate(params.get("config") or {}), params.get("recipe"))
    lineage = Lineage.find(config.tracking.uri, Run.of(config))
    run_id = lineage.ref.mlflow_run_id if lineage is not None and lineage.close_if_running(status) else None
    if run_id:
        print(f"lineage {config.run_name}: MLflow run {run_id} marked {status} ({flow_run.name})", flush=True)
    return run_id


@task(name="close-crashed-lineage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def close_crashed_lineage(flow_run_id: str) -> str | None:
    """A flow run that crashed with its process (a dead worker, an evicted container: marked Crashed by the
    heartbeat automation of deploy/automations.yaml) cannot close its lineage itself: mark its MLflow run
    FAILED here. The lineage's lease expires by itself; the next run resumes as a new attempt."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        crashed = client.read_flow_run(UUID(flow_run_id.removeprefix("prefect.flow-run.")))
    if "config" not in (crashed.parameters or {}) and "recipe" not in (crashed.parameters or {}):
        get_run_logger().info(f"flow run {crashed.name} trains no lineage; nothing to close")
        return None
    return _close_from_hook(crashed, "FAILED")


def lineage_killed(flow, flow_run, state) -> None:
    """Flow hook on cancellation: the lineage's MLflow run, if still RUNNING, ends KILLED."""
    _close_from_hook(flow_run, "KILLED")


def lineage_crashed(flow, flow_run, state) -> None:
    """Flow hook on a crash: the lineage's MLflow run, if still RUNNING (the flow body did not close it), ends FAILED."""
    _close_from_hook(flow_run, "FAILED")


@contextmanager
def lineage_lease(config: RunConfig) -> Iterator[lease.Lease]:
    """Hold the lease of runs/<run_name> meanwhile: one run writes a lineage at a time (see lmyard.tracking.lease).
    Released at the end, on success, failure and cancellation alike. Lost to another run (this process stalled
    past its ttl), it stops the jobs this process follows: their trainers end with LeaseLost."""
    from prefect.runtime import flow_run

    held = lease.acquire(
        Run.of(config),
        {"flow_run": f"{flow_run.name or '-'} ({flow_run.id or '-'})"},
        ttl_s=config.tracking.lease_ttl_s,
        wait_s=config.tracking.lease_wait_s,
        on_lost=stop_all,
    )
    try:
        yield held
    finally:
        held.release()
