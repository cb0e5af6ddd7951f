"""Close the run: summary artifacts in MLflow and Prefect, final status."""

from __future__ import annotations

import yaml
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from lmyard import tracking
from lmyard.config import RunConfig
from lmyard.shards import ShardSet
from tasks._common import artifact_key


@task(name="finish", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def finish(config: RunConfig, shards: ShardSet, lineage: tracking.Lineage, trained: dict, evaluation: dict) -> dict:
    """Log config, manifest and summary; mark the MLflow run FINISHED."""
    summary = {"run_name": config.run_name, "mlflow_run_id": lineage.mlflow_run_id, "attempt": lineage.attempt,
               "shard_address": shards.address, "steps": trained["step"], "tokens_seen": trained["tokens_seen"],
               "train_loss": trained["train_loss"], "val_loss": evaluation["val_loss"],
               "checkpoint": evaluation["checkpoint"]}
    tracking.log_artifact_text(lineage, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), "config.yaml")
    tracking.log_artifact_dict(lineage, shards.manifest, "shards/manifest.json")
    tracking.log_artifact_dict(lineage, summary, "summary.json")
    tracking.close_lineage(lineage, "FINISHED")
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    samples = "\n\n".join(f"**{s['prompt']}**{s['completion']}" for s in evaluation["samples"])
    create_markdown_artifact(
        key=artifact_key(config.run_name, "summary"),
        markdown=f"# {config.run_name}\n\n| | |\n|---|---|\n{rows}\n\n## Samples\n\n{samples}\n",
        description=f"Summary of {config.run_name}")
    return summary
