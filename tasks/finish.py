"""Close the run: summary artifacts in MLflow and Prefect, final status."""

from __future__ import annotations

import yaml
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from lmyard.config import RunConfig
from lmyard.data.shards import ShardSet
from lmyard.tracking.lineage import Lineage
from tasks._common import artifact_key


@task(name="finish", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def finish(config: RunConfig, shards: ShardSet, lineage: Lineage, trained: dict, evaluation: dict, model: dict) -> dict:
    """Log config, manifest, loss curve and summary; mark the MLflow run FINISHED."""
    attempts = lineage.attempts()
    hs = evaluation.get("hellaswag")
    summary = {
        "run_name": config.run_name,
        "mlflow_run_id": lineage.mlflow_run_id,
        "attempts": len(attempts),
        "shard_address": shards.address,
        "steps": trained["step"],
        "tokens_seen": trained["tokens_seen"],
        "train_loss": trained["train_loss"],
        "val_loss": evaluation["val_loss"],
        "hellaswag_acc_norm": hs["acc_norm"] if hs else None,
        "checkpoint": evaluation["checkpoint"],
        "registered_model": f"{model['name']}/{model['version']}",
        "alias": model["alias"],
    }
    lineage.log_text(yaml.safe_dump(config.redacted_dump(), sort_keys=False), "config.yaml")
    lineage.log_dict(shards.manifest, "shards/manifest.json")  # not a store key
    lineage.log_dict(attempts, "attempts.json")
    lineage.log_loss_curve()
    lineage.log_dict(summary, "summary.json")
    lineage.close("FINISHED")
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    tries = "\n".join(
        f"| {a['attempt']} | {a.get('start_step', '')} | {a.get('resumed_from') or '-'} | "
        f"{a.get('flow_run_id', '')} | {a.get('nodes', '')} | {a.get('outcome', '')} |"
        for a in attempts
    )
    gates = (
        "\n".join(
            f"| {k} | {g['value']} | {g['limit']} | {'pass' if g['passed'] else 'FAIL'} |"
            for k, g in model["gates"].items()
        )
        or "| (none configured) | | | |"
    )
    samples = "\n\n".join(f"**{s['prompt']}**{s['completion']}" for s in evaluation["samples"])
    create_markdown_artifact(
        key=artifact_key(config.run_name, "summary"),
        markdown=f"# {config.run_name}\n\n| | |\n|---|---|\n{rows}\n\n"
        f"## Attempts\n\n| # | start step | resumed from | flow run | nodes | outcome |\n|---|---|---|---|---|---|\n{tries}\n\n"
        f"## Gates\n\n| gate | value | limit | |\n|---|---|---|---|\n{gates}\n\n## Samples\n\n{samples}\n",
        description=f"Summary of {config.run_name}",
    )
    return summary
