"""An evaluation on the lineage's MLflow run: its metrics at the checkpoint's step (linked to the checkpoint's
logged model), one row in the run's tables, its whole result as JSON, and the bookkeeping that says which
checkpoint of the step it was (lmyard.tracking.bookkeeping). Names: lmyard.tracking.schema.

The metrics are the evaluations' own (each `Score` of the EvalResult: lmyard.evaluate.spec) and
`system/eval/seconds`. The samples of every evaluated step go to one table (evals/samples.json: step, prompt,
completion), as do the checkpoints' metrics (evals/checkpoints.json), appended at each evaluation.
"""

from __future__ import annotations

import time

from lmyard.stages import EvalResult
from lmyard.tracking import bookkeeping, schema
from lmyard.tracking.lineage import DAMAGED_TAG, Lineage


def evaluated_checkpoints(lineage: Lineage) -> dict[int, str | None]:
    """step -> the commit id of the checkpoint evaluated at that step (None: logged without one)."""
    return bookkeeping.evaluated(lineage, sorted(lineage.metric_history(schema.EVALUATED)))


def log_evaluation(lineage: Lineage, r: EvalResult, commit: str = "") -> None:
    """The evaluation of one checkpoint, logged at its step; its metrics last (their step marks it evaluated)."""
    step = r.step
    lineage.log_table(_score_row(r), schema.EVAL_TABLE)  # appended: one table across steps
    if r.samples:
        columns = {
            "step": [step] * len(r.samples),
            "prompt": [s.prompt for s in r.samples],
            "completion": [s.completion for s in r.samples],
        }
        lineage.log_table(columns, schema.SAMPLES_TABLE)
    lineage.log_dict(r.model_dump(mode="json"), schema.EVAL_RESULT.format(step))
    lineage.set_tags({schema.LATEST_EVALUATED: r.checkpoint})
    bookkeeping.update(lineage, step, evaluated=commit)
    # the checkpoint as an MLflow logged model (a pointer, no weights), its metrics linked to it
    model_id = lineage.log_checkpoint_model(
        step,
        r.checkpoint,
        {"checkpoint": r.checkpoint, "step": step, "tokens_seen": r.tokens_seen, "val_loss": r.val_loss},
    )
    lineage.log_metrics({**r.metrics, schema.EVAL_SECONDS: r.eval_s}, step, model_id=model_id)


def _score_row(r: EvalResult) -> dict[str, list]:
    """The checkpoint, its val loss (the evaluator's and the trainer's), then every other metric by its name."""
    row = {
        "step": r.step,
        "checkpoint": r.checkpoint,
        "tokens_seen": r.tokens_seen,
        "val_loss": r.val_loss,
        "trainer_val_loss": r.trainer_val_loss,
    }
    row |= {k: v for k, v in r.metrics.items() if k != schema.EVAL_LOSS}
    return {k: [v] for k, v in row.items()}


def mark_damaged_evaluation(lineage: Lineage, step: int, where: str) -> None:
    """The evaluation logged earlier at `step` was of a checkpoint since moved aside (to `where`) as damaged:
    say so on the run and retire its logged model, before the new checkpoint's results are logged there."""
    note = f"the results logged at step {step} before {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} are of a "
    lineage.set_tags({schema.DAMAGED_EVALUATION.format(step): note + f"damaged checkpoint, moved to {where}"})
    lineage.retire_checkpoint_models([step], tag=DAMAGED_TAG, reason=f"found damaged and moved to {where}")


def record_failure(lineage: Lineage, step: int, error: str) -> None:
    """A failed evaluation: a run tag at its step and evals/failed_step_N.json."""
    lineage.set_tags({schema.EVAL_FAILED_TAG.format(step): error[:4000]})
    lineage.log_dict({"step": step, "error": error}, schema.EVAL_FAILED.format(step))
