"""The built-in evaluations as specs (lmyard.evaluate.spec): val loss, HellaSwag-format multiple choice,
lm-evaluation-harness, samples. Torch-free: each `run` loads lmyard.evaluate.evals, in the evaluator's process."""

from __future__ import annotations

from typing import Any

from lmyard.evaluate.spec import Context, EvaluationSpec
from lmyard.tracking import schema


def _evals():
    from lmyard.evaluate import evals

    return evals


def _val_loss(ctx: Context) -> Any:
    return _evals().run_val_loss(ctx)


def _hellaswag(ctx: Context) -> Any:
    return _evals().run_hellaswag(ctx)


def _harness(ctx: Context) -> Any:
    return _evals().run_harness(ctx)


def _samples(ctx: Context) -> Any:
    return _evals().run_samples(ctx)


VAL_LOSS = EvaluationSpec(
    name="val_loss",
    run=_val_loss,
    metrics=lambda r: {schema.EVAL_LOSS: r.loss},
    rows=lambda r: {"val loss": f"{r.loss:.4f}"},
    gates={"val_loss_max": schema.EVAL_LOSS},
)
HELLASWAG = EvaluationSpec(
    name="hellaswag",
    run=_hellaswag,
    enabled=lambda e: e.hellaswag is not None,
    metrics=lambda r: {"task/hellaswag_acc": r.acc, "task/hellaswag_acc_norm": r.acc_norm},
    rows=lambda r: {"HellaSwag acc": f"{r.acc:.4f} ({r.n} examples)", "HellaSwag acc_norm": f"{r.acc_norm:.4f}"},
    gates={"hellaswag_acc_norm_min": "task/hellaswag_acc_norm"},
)
HARNESS = EvaluationSpec(
    name="harness",
    run=_harness,
    enabled=lambda e: bool(e.harness_tasks),
    metrics=lambda r: {f"task/{k}": v for k, v in r.metrics.items()},
)
SAMPLES = EvaluationSpec(
    name="samples",
    run=_samples,
    enabled=lambda e: bool(e.prompts) and e.sample_tokens > 0,
    metrics=lambda r: {},
    samples=lambda r: [(s.prompt, s.completion) for s in r.items],
)
