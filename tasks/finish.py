"""Close the run: summary artifacts in MLflow and Prefect, final status."""

from __future__ import annotations

import yaml
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.stages import TrainResult
from lmyard.tracking.lineage import Lineage
from lmyard.tracking.runs import run_url, version_url
from tasks._common import artifact_key
from tasks.results import Evaluation, RegisteredModel, RunSummary


@task(name="finish", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def finish(
    config: RunConfig,
    shards: ShardSet,
    lineage: Lineage,
    trained: TrainResult,
    evaluations: list[Evaluation],
    model: RegisteredModel | None,
) -> RunSummary:
    """Log config, manifest, loss curve and summary; mark the MLflow run FINISHED. `evaluations`: every
    checkpoint's, the final one last; those that failed are listed in the summary."""
    attempts = lineage.attempts()
    final = evaluations[-1]
    evaluated = final.result.val_loss if final.result else None
    summary = RunSummary(
        run_name=config.run_name,
        mlflow_run_id=lineage.ref.mlflow_run_id,
        attempts=len(attempts),
        shard_address=shards.address,
        steps=trained.step,
        tokens_seen=trained.tokens_seen,
        train_loss=trained.train_loss,
        val_loss=evaluated if evaluated is not None else trained.val_loss,
        metrics=final.result.metrics if final.result else {},
        checkpoint=final.checkpoint,
        registered_model=f"{model.name}/{model.version}" if model else None,
        alias=model.alias if model else None,
        failed_evaluations={e.step: e.error for e in evaluations if e.error},
    )
    lineage.log_text(yaml.safe_dump(config.redacted_dump(), sort_keys=False), "config.yaml")
    lineage.log_dict(shards.manifest, "shards/manifest.json")  # not a store key
    lineage.log_dict(attempts, "attempts.json")
    lineage.log_loss_curve()
    lineage.log_dict(summary.model_dump(mode="json"), "summary.json")
    lineage.close("FINISHED")
    create_markdown_artifact(
        key=artifact_key(config.run_name, "summary"),
        markdown=_links(lineage, model) + "\n\n" + _markdown(summary, attempts, model, final),
        description=f"Summary of {config.run_name}",
    )
    return summary


def _links(lineage: Lineage, model: RegisteredModel | None) -> str:
    """Markdown links to the lineage's MLflow run and the registered version (a local store's pages open once
    `mlflow ui --backend-store-uri ...` serves them); they point at the lineage's own tracking server."""
    uri = lineage.ref.tracking_uri
    run = f"[MLflow run {lineage.ref.mlflow_run_id}]({run_url(uri, lineage.ref.experiment_id, lineage.ref.mlflow_run_id)})"
    if model is None:
        return run
    return run + f" · [models:/{model.name}/{model.version}]({version_url(uri, model.name, model.version)})"


def _markdown(summary: RunSummary, attempts: list[dict], model: RegisteredModel | None, final: Evaluation) -> str:
    rows = "\n".join(f"| {k} | {_cell(v)} |" for k, v in summary.model_dump(exclude={"metrics"}).items())
    scores = "\n".join(f"| {k} | {v} |" for k, v in (final.result.rows if final.result else {}).items())
    tries = "\n".join(
        f"| {a['attempt']} | {a.get('start_step', '')} | {a.get('resumed_from') or '-'} | "
        f"{_flow_run(a)} | {a.get('nodes', '')} | {_cell(a.get('gpu_hours', ''))} | {a.get('outcome', '')} |"
        for a in attempts
    )
    gates = (
        "\n".join(
            f"| {k} | {_cell(g.value)} | {_cell(g.limit)} | {'pass' if g.passed else 'FAIL'} |"
            for k, g in (model.gates if model else {}).items()
        )
        or "| (none configured) | | | |"
    )
    samples = "\n\n".join(f"**{s.prompt}**{s.completion}" for s in (final.result.samples if final.result else []))
    return (
        f"# {summary.run_name}\n\n| | |\n|---|---|\n{rows}\n\n"
        f"## Final evaluation\n\n| | |\n|---|---|\n{scores or '| (failed) | |'}\n\n"
        "## Attempts\n\n| # | start step | resumed from | flow run | nodes | GPU-hours | outcome |\n"
        f"|---|---|---|---|---|---|---|\n{tries}\n\n"
        f"## Gates\n\n| gate | value | limit | |\n|---|---|---|---|\n{gates}\n\n## Samples\n\n{samples}\n"
    )


def _cell(value) -> str:
    """A table cell: a float to 4 significant digits (a loss, GPU-hours), anything else as it is."""
    if isinstance(value, str):
        try:
            value = float(value) if "." in value else value
        except ValueError:
            return value
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _flow_run(attempt: dict) -> str:
    run_id, url = attempt.get("flow_run_id", ""), attempt.get("flow_run_url")
    return f"[{run_id}]({url})" if url else run_id
