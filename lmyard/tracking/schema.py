"""The names a lineage's MLflow run is read by: its metrics, tags and artifacts.

The run page reads as a training run. MLflow's Model metrics tab groups metrics by the part before `/`,
sections in name order, the unprefixed ones last, and keeps every `system/` metric to its System metrics tab. So
the losses come first, in one section: `loss/train` (the trainer, every log step), `loss/val` (the trainer,
every eval.interval) and `loss/eval` (the evaluator, every checkpoint: the same routine as `loss/val`); then the
scores of the evaluations (`task/*`) and the trainer's unprefixed ones (lr, grad norm, tokens/s). The plumbing
(`system/checkpoint/*`, `system/eval/seconds`, `system/restart/*`, `system/goodput/*`, `system/guard/*`) lies beside MLflow's
own system metrics. No metric is a timestamp. Bookkeeping (which checkpoint of a step was
recorded and evaluated: a step trained again after a fallback holds another one) is no run tag: it is the
JSON artifact BOOKKEEPING (lmyard.tracking.bookkeeping), out of the run page's way.
"""

from __future__ import annotations

TRAIN_LOSS = "loss/train"
VAL_LOSS = "loss/val"
EVAL_LOSS = "loss/eval"
LOSSES = (TRAIN_LOSS, VAL_LOSS, EVAL_LOSS)
EVAL_SECONDS = "system/eval/seconds"
RESTART_METRICS = "system/restart/"  # an attempt's launch to its first step, in parts, at its first step
GOODPUT_METRICS = "system/goodput/"  # the lineage's goodput and badput by cause (lmyard.train.components.Goodput)
EVALUATED = EVAL_LOSS  # the metric whose steps say which checkpoints have been evaluated

# artifacts
BOOKKEEPING = "lmyard/checkpoints.json"  # step -> the commit times recorded and evaluated there
EVAL_TABLE = "evals/checkpoints.json"  # one row per evaluated checkpoint: step, checkpoint, losses, scores
SAMPLES_TABLE = "evals/samples.json"  # one row per prompt and evaluated checkpoint
EVAL_RESULT = "evals/step_{:08d}.json"  # a checkpoint's whole EvalResult
EVAL_FAILED = "evals/failed_step_{:08d}.json"

# tags
LATEST_EVALUATED = "lmyard.latest_evaluated_checkpoint"
EVAL_FAILED_TAG = "lmyard.eval_failed.step_{:08d}"
DAMAGED_EVALUATION = "lmyard.eval_of_damaged.step_{:08d}"  # the step's earlier result was of a damaged checkpoint
