"""Launch the trainer on every node and follow it to the end."""

from __future__ import annotations

import socket
import time
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from lmyard import console
from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.errors import retryable
from lmyard.launch.elastic import Resize, attempt_hosts, record_resize
from lmyard.launch.follower import stop_all
from lmyard.stages import Progress, Started, TrainResult, TrainSpec
from lmyard.tracking.lease import LeaseRef
from lmyard.tracking.lineage import Lineage, LineageRef
from tasks._common import artifact_key, flow_run_url, launch_stage

STOP_SLACK_S = 30.0  # beyond launch.grace_s: the follower kills what is left, reads the result, removes the job


# flow runs whose training was stopped (an interrupt, a failure of the flow): their train task is not retried
_STOPPED_FLOW_RUNS: set[str] = set()


def retry_if_it_can_help(task, task_run, state) -> bool:
    """Retry condition: a crash, a lost node, a store outage or a preemption is retried (each resumes from the
    newest checkpoint); bad input, divergence (the guard already had its say) and a lost lease are not, nor a
    training its flow stopped (stop_training)."""
    if str(task_run.flow_run_id) in _STOPPED_FLOW_RUNS:
        return False
    return retryable(state.result(raise_on_failure=False))


# The flow sets the retry count from config.launch.retries.
@task(name="train", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, retry_condition_fn=retry_if_it_can_help)
def train(config: RunConfig, shards: ShardSet, lineage: Lineage, lease: LeaseRef | None = None) -> TrainResult:
    """Run torchrun with the trainer; resumes from the newest complete checkpoint, as a new attempt. With the
    flow's `lease`, the trainer stops (LeaseLost, not retried) once another run holds the lineage."""
    logger = get_run_logger()
    lineage = lineage.record_attempt(
        resumed_from=None,
        start_step=0,
        info={
            "flow_run_id": flow_run.get_id() or "",
            "flow_run_count": flow_run.get_run_count(),
            "task_run_count": task_run.get_run_count(),
            "nodes": config.launch.nnodes,
            "hosts": ", ".join(attempt_hosts(config)),
            "gpus_per_node": config.launch.nproc_per_node if config.train.device == "cuda" else 0,  # until started
            "world_size": config.world_size(),
            "host": socket.gethostname(),
        }
        | ({"gpu_hour_price": config.tracking.gpu_hour_price} if config.tracking.gpu_hour_price is not None else {})
        | ({"flow_run_url": url} if (url := flow_run_url()) else {}),  # the MLflow run links its flow runs
    )
    # the flow evaluates every checkpoint: retention keeps each one until its evaluation has ended
    spec = TrainSpec(config=config, shards=shards, lineage=lineage.ref, lease=lease, hold_for_eval=True)

    def started(s: Started) -> None:
        """What the trainer actually loaded (after any fallback) becomes the attempt's record."""
        gpus = config.launch.nproc_per_node if s.device == "cuda" else 0  # one rank per GPU
        lineage.record_resume(resumed_from=s.resumed_from, start_step=s.start_step, gpus_per_node=gpus, hosts=s.hosts)
        logger.info(
            f"attempt {lineage.ref.attempt} of lineage {config.run_name}: "
            + (f"resumed from {s.resumed_from} at step {s.start_step}" if s.resumed_from else "started fresh")
            + (f"; skipped damaged {s.skipped_damaged}" if s.skipped_damaged else "")
        )

    def resized(r: Resize) -> LineageRef:
        """A lost node or one back (lmyard.launch.elastic, whose one line the log has): the attempt ends, the next
        one on the new size begins."""
        nonlocal lineage
        lineage = record_resize(lineage, r)
        return lineage.ref

    try:
        result = launch_stage(
            spec, logger.info, on_progress=_progress_artifact(config), on_started=started, on_resize=resized
        )
    except BaseException as e:
        lineage.end_attempt("failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    lineage.end_attempt("finished", f"step {result.step}")
    return result


def _progress_artifact(config: RunConfig):
    """A Prefect progress artifact fed by the trainer's progress file (at most every 2 s, and the last step)."""
    artifact_id: UUID = create_progress_artifact(  # type: ignore[assignment]  # a UUID when called from sync code
        0.0, key=artifact_key(config.run_name, "train-progress"), description="train: starting"
    )
    last = 0.0

    def on_progress(p: Progress) -> None:
        nonlocal last
        figures = (f"loss {p.loss:.4f}" if p.loss is not None else "") + (
            f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""
        )
        console.progress("train", p.step, p.max_steps, figures)  # a bar with an ETA on a terminal
        if time.monotonic() - last > 2.0 or p.step == p.max_steps:
            last = time.monotonic()
            text = f"step {p.step}/{p.max_steps}" + (f", {figures}" if figures else "")
            update_progress_artifact(artifact_id, 100.0 * p.step / p.max_steps, description=text)

    return on_progress


def stop_training(config: RunConfig) -> int:
    """Stop the trainers this process follows (SIGTERM: each checkpoints and ends as preempted), e.g. when the
    flow fails or is interrupted while the train task runs in a worker thread; local, Docker and Ray jobs alike.

    Waits until they have ended (the preemption checkpoint committed, or `launch.grace_s` spent): the flow
    releases the lineage's lease only after this, and a trainer may commit only while the lease is held. The
    stopped train task is not retried."""
    _STOPPED_FLOW_RUNS.add(str(flow_run.get_id()))
    return stop_all(wait_s=config.launch.grace_s + STOP_SLACK_S)
