"""Evaluate the newest checkpoint and log the results to the lineage's MLflow run."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from lmyard import evals, tracking
from lmyard.config import RunConfig
from lmyard.shards import ShardSet
from tasks._common import artifact_key


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(config: RunConfig, shards: ShardSet, lineage: tracking.Lineage) -> dict:
    """Val loss and samples of the newest checkpoint, logged at its step."""
    logger = get_run_logger()
    result = evals.evaluate_latest(config, shards)
    step = result["step"]
    tracking.log_metrics(lineage, {"eval/val_loss": result["val_loss"]}, step)
    text = "\n\n".join(f"### {s['prompt']}\n{s['prompt']}{s['completion']}" for s in result["samples"])
    tracking.log_artifact_text(lineage, text, f"samples/step_{step:08d}.md")
    create_table_artifact(key=artifact_key(config.run_name, "samples"),
                          table=[{"prompt": s["prompt"], "completion": s["completion"]} for s in result["samples"]],
                          description=f"Samples of {config.run_name} at step {step}")
    logger.info(f"step {step}: val loss {result['val_loss']:.4f} ({result['checkpoint']})")
    for s in result["samples"]:
        logger.info(f"sample: {s['prompt']!r} -> {s['completion'][:200]!r}")
    return result
