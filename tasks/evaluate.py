"""Evaluate checkpoints (the evaluate stage, launched on config.launch.backend) and log the results to the
lineage's MLflow run. An evaluation that fails is recorded, never raised: it does not fail the training run.

Each checkpoint is evaluated and logged once per lineage (what is logged: lmyard.evaluate.history). A
checkpoint is its step and its manifest's commit time: the run's bookkeeping (lmyard.tracking.bookkeeping)
holds the commit time of the checkpoint evaluated at step N. After a fallback (a damaged checkpoint moved to
runs/<run>/damaged/, its step trained again) the step holds another checkpoint: it is evaluated again, its
results logged at the same step after the damaged one's, which is marked (the run tag
`lmyard.eval_of_damaged.step_N`, its logged model FAILED with `lmyard.checkpoint_damaged`).

Design notes: docs/export.md, `tasks/evaluate.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from lmyard import console
from lmyard.checkpoint import catalog
from lmyard.checkpoint.commit import upload_backoff
from lmyard.checkpoint.manifest import DamagedCheckpoint
from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.errors import one_line
from lmyard.evaluate.history import evaluated_checkpoints, log_evaluation, mark_damaged_evaluation, record_failure
from lmyard.run import Run
from lmyard.stages import EvalResult, EvalSpec
from lmyard.tracking.lineage import Lineage
from tasks._common import artifact_key, launch_stage
from tasks.results import Evaluation

OUTAGE_WARN_EVERY_S = 30.0  # a store that stays unreachable is said once, then again at this pace


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE, task_run_name="evaluate-step-{step}")
def evaluate_checkpoint(config: RunConfig, shards: ShardSet, lineage: Lineage, step: int) -> Evaluation:
    """Every evaluation the run enables on one checkpoint (`python -m lmyard.stages evaluate` on eval.device),
    logged at its step. A failure (the evaluator's, or logging's) is recorded on the MLflow run and returned
    in the Evaluation: an evaluation never turns a training run into a failed one."""
    logger, run = get_run_logger(), Run.of(config)
    try:
        commit = commit_id(run, step)  # before: which checkpoint is read
        result = launch_stage(EvalSpec(config=config, shards=shards, step=step), logger.info)
        _record(run, config.train.max_steps, lineage, result, commit)
    except Exception as e:  # any failure of this evaluation: recorded below; interrupts and cancellation pass
        error = f"{type(e).__name__}: {one_line(e)}"
        logger.error(f"evaluation of step {step} failed; training goes on: {error}")
        _record_failure(lineage, step, error, logger.warning)
        checkpoint = run.uri(run.layout.step(step))
        return Evaluation(step=step, checkpoint=checkpoint, error=error)
    return Evaluation(step=step, checkpoint=result.checkpoint, result=result)


def commit_id(run: Run, step: int) -> str:
    """Which checkpoint of `step` the store holds now: its manifest's commit time ("" in a manifest without, or
    in one that is not a manifest: its evaluation, not this look, says that it is damaged)."""
    try:
        committed = catalog.read_manifest(run, step).committed
    except DamagedCheckpoint:
        return ""
    return "" if committed is None else repr(committed)


def _record(run: Run, final_step: int, lineage: Lineage, result: EvalResult, commit: str) -> None:
    """The result to MLflow (once per checkpoint: a retried attempt's repeat is not logged again) and Prefect."""
    logger, step = get_run_logger(), result.step
    earlier = evaluated_checkpoints(lineage)
    if step in earlier and earlier[step] in (None, commit):
        logger.info(f"step {step} was evaluated by an earlier attempt; its results are not logged again")
        return
    if step in earlier:  # the step was trained again after a fallback: the earlier result is a damaged one's
        moved = catalog.damaged(run).get(step, [])
        where = moved[-1] if moved else "the damaged folder"
        logger.warning(
            f"step {step} was trained again after its checkpoint was found damaged ({where}); evaluating the new one"
        )
        mark_damaged_evaluation(lineage, step, where)
    log_evaluation(lineage, result, commit)
    create_table_artifact(
        key=artifact_key(run.name, f"eval-step-{step:08d}"),
        table=_table(result),
        description=f"Evaluation of {run.name} at step {step} ({result.checkpoint})",
    )
    scores = ", ".join(f"{what} {value}" for what, value in result.rows.items())
    logger.info(f"step {step}: {scores} in {result.eval_s:.1f} s on {result.device} ({result.checkpoint})")
    if step == final_step:  # the final checkpoint's samples; MLflow has every checkpoint's
        for sample in result.samples:
            logger.info(console.sample_text(step, sample.prompt, sample.completion))


def _record_failure(lineage: Lineage, step: int, error: str, warn) -> None:
    """The failed evaluation on the lineage's MLflow run: a tag per step and evals/failed_step_N.json."""
    try:
        record_failure(lineage, step, error)
    except Exception as e:  # the tracking server itself is down: the flow's result still holds the failure
        warn(f"could not record the failed evaluation of step {step} in MLflow: {one_line(e)}")


def new_checkpoints(config: RunConfig, lineage: Lineage, training: PrefectFuture, log=None) -> Iterator[int]:
    """Steps of complete checkpoints not yet evaluated, as they appear while `training` runs (a step trained
    again after a fallback holds a new checkpoint: it comes again; see the module doc).

    Polls the store every eval.poll_s seconds. The final checkpoint (train.max_steps) is left out: the
    flow evaluates it itself, with the training result in hand. A look that fails (the store briefly
    unreachable) is tried again at the next poll, for as long as the trainer's uploads would retry
    (checkpoint.upload_retries); only an outage longer than that ends the flow, never a blip.
    """
    run = Run.of(config)
    log = log or get_run_logger().warning
    done = evaluated_checkpoints(lineage)  # step -> commit id of the checkpoint evaluated there
    budget = outage_budget_s(config)
    failing_since: float | None = None
    said_at = 0.0
    while True:
        training.wait(timeout=config.eval.poll_s)
        finished = training.state.is_final()  # read before listing: the last listing sees every checkpoint
        if config.eval.watch or finished:
            try:
                fresh = _unevaluated(run, done, final=config.train.max_steps)
            except Exception as e:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > budget:
                    raise
                if now - said_at >= OUTAGE_WARN_EVERY_S:  # once when it starts, then every 30 s
                    said_at = now
                    log(
                        f"looking for new checkpoints failed ({one_line(e)}); trying again every "
                        f"{config.eval.poll_s:g} s (for up to {budget:.0f} s)"
                    )
                if finished:  # the ended future's wait returns at once: wait here instead
                    time.sleep(config.eval.poll_s)
                continue
            failing_since, said_at = None, 0.0
            for step, commit in fresh:
                done[step] = commit
                yield step
        if finished:
            return


def _unevaluated(run: Run, done: dict[int, str | None], final: int) -> list[tuple[int, str]]:
    """(step, commit id) of the complete checkpoints not in `done`, or in it but of another commit where the step
    was moved aside as damaged (only those manifests are read again); the `final` step is the flow's own."""
    steps = catalog.complete_steps(run)
    moved = catalog.damaged(run) if any(s in done for s in steps) else {}
    fresh = []
    for step in steps:
        if step == final or (step in done and (step not in moved or done[step] is None)):
            continue
        commit = commit_id(run, step)
        if done.get(step) != commit:
            fresh.append((step, commit))
    return fresh


def outage_budget_s(config: RunConfig) -> float:
    """The seconds a store may stay unreachable: what the trainer's upload retries wait (1, 2, 4 ... 30 s)."""
    return upload_backoff().total(config.checkpoint.upload_retries + 1) + 30.0


def _table(r: EvalResult) -> list[dict]:
    """The checkpoint, every evaluation's rows, then its samples: the Prefect table of one evaluation."""
    rows = [{"what": "checkpoint", "value": r.checkpoint}]
    rows += [{"what": what, "value": value} for what, value in r.rows.items()]
    return rows + [{"what": f"sample: {s.prompt}", "value": s.completion} for s in r.samples]
