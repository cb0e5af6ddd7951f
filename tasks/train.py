"""Launch the trainer on every node and follow it to the end."""

from __future__ import annotations

import re
import socket
import time

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from lmyard import checkpoint, tracking
from lmyard.config import RunConfig
from lmyard.launch import run_local
from lmyard.shards import ShardSet
from lmyard.store import open_store
from tasks._common import artifact_key, not_a_user_error

_STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|")


# A failed launch (a dead node or container, a crashed rank, a stalled job) fails the task; the retry
# resumes from the newest complete checkpoint. The flow sets the count from config.launch.retries.
@task(name="train", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, retry_condition_fn=not_a_user_error)
def train(config: RunConfig, shards: ShardSet, lineage: tracking.Lineage) -> dict:
    """Run torchrun with the trainer; resumes from the newest complete checkpoint, as a new attempt."""
    logger = get_run_logger()
    lineage = _record_attempt(config, lineage)
    logger.info(f"attempt {lineage.attempt} of lineage {config.run_name}: "
                + (f"resuming from {lineage.resumed_from}" if lineage.resumed_from else "starting fresh"))
    # the flow evaluates every checkpoint: retention keeps each one until its evaluation has ended
    spec = {"config": config.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": lineage.to_dict(),
            "hold_for_eval": True}
    on_line = _with_progress(config, logger.info)
    try:
        result = _launch(config, spec, on_line)
    except BaseException as e:
        tracking.end_attempt(lineage, "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    tracking.end_attempt(lineage, "finished", f"step {result['step']}")
    return {**result, "attempt": lineage.attempt}


def _launch(config: RunConfig, spec: dict, on_line) -> dict:
    """torchrun here (`local`), or in one container per node (`docker`)."""
    if config.launch.backend == "docker":
        from lmyard.launch_docker import run_docker

        return run_docker(config, spec, on_line=on_line, flow_run_id=flow_run.get_id())
    return run_local(config, spec, on_line=on_line)


def _record_attempt(config: RunConfig, lineage: tracking.Lineage) -> tracking.Lineage:
    store = open_store(config.store)
    steps = checkpoint.complete_steps(store, config.run_name)
    return tracking.record_attempt(
        lineage, resumed_from=store.uri(checkpoint.step_prefix(config.run_name, steps[-1])) if steps else None,
        start_step=steps[-1] if steps else 0,
        info={"flow_run_id": flow_run.get_id() or "", "flow_run_count": flow_run.get_run_count(),
              "task_run_count": task_run.get_run_count(), "nodes": config.launch.nnodes,
              "world_size": config.world_size(), "host": socket.gethostname()})


def _with_progress(config: RunConfig, log):
    """Forward trainer lines to `log`, and show `step N/M` lines in a Prefect progress artifact (every >= 2 s)."""
    artifact_id = create_progress_artifact(0.0, key=artifact_key(config.run_name, "train-progress"),
                                           description="train: starting")
    last = 0.0

    def on_line(line: str) -> None:
        nonlocal last
        log(line)
        m = _STEP_LINE.match(line)
        if m and (time.monotonic() - last > 2.0 or m.group(1) == m.group(2)):
            last = time.monotonic()
            step, total = int(m.group(1)), int(m.group(2))
            update_progress_artifact(artifact_id, 100.0 * step / total, description=line[:500])
    return on_line


def stop_training() -> None:
    """End the trainers this process launched (torchrun forwards SIGTERM to its ranks), e.g. when the flow is
    interrupted while the train task runs in a worker thread."""
    import psutil

    for proc in psutil.Process().children():
        try:
            if "torch.distributed.run" in " ".join(proc.cmdline()) and "lmyard.train" in " ".join(proc.cmdline()):
                proc.terminate()
        except psutil.NoSuchProcess:
            pass
