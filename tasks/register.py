"""Register the final model in the MLflow model registry; alias it when the eval gates pass (and, with
eval.approval, once a person approves: `approve_promotion`, called by the flow).

When every gate passes, the event `lmyard.gates.passed` (resource `lmyard.model.NAME.VERSION`, related to the
flow run and the tag `lmyard`) is emitted: deploy/automations.yaml's notification reacts to it."""

from __future__ import annotations

import os
import tempfile
import time

from prefect import get_run_logger, pause_flow_run, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.exceptions import FlowPauseTimeout
from prefect.input import RunInput

from lmyard import backends
from lmyard.checkpoint import retention
from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.evaluate.gates import gate_results
from lmyard.run import Run
from lmyard.stages import ExportResult, ExportSpec
from lmyard.tracking import model_registry
from lmyard.tracking.lineage import Lineage
from lmyard.tracking.runs import run_url, version_url
from tasks._common import flow_run_url, launch_stage
from tasks.results import Evaluation, Gate, RegisteredModel


@task(name="register-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def register_model(config: RunConfig, shards: ShardSet, lineage: Lineage, final: Evaluation) -> RegisteredModel:
    """The final checkpoint exported to Hugging Face format and logged as an MLflow pyfunc model (weights in
    the artifact store), registered as a new version; eval.alias only if every gate passes (a final evaluation
    that failed passes none: the model is registered, without the alias)."""
    logger = get_run_logger()
    name = config.tracking.registered_model or config.run_name
    with tempfile.TemporaryDirectory(prefix="lmyard-register-", ignore_cleanup_errors=True) as tmp:
        folder = os.path.join(tmp, "hf_model")  # its name in the logged model: artifacts/hf_model
        info = _export(config, final.checkpoint, folder)
        params = {
            "checkpoint_uri": info.checkpoint,
            "step": str(info.step),
            "tokens_seen": str(info.tokens_seen),
            "hf_architecture": info.hf_architecture,
            "tokenizer": config.tokenizer.name,
            "shard_address": shards.address,
        }
        tags = {"lmyard.run_name": config.run_name, "lmyard.shard_address": shards.address}
        model_id = model_registry.log_hf_model(lineage, name, folder, info.step, params, tags)
        size_mb = sum(e.stat().st_size for e in os.scandir(folder)) / 1e6
        logger.info(
            f"exported {info.checkpoint} as {info.hf_architecture} ({size_mb:.1f} MB) and logged "
            f"it as MLflow model models:/{model_id}"
        )
    rows = final.result.rows.items() if final.result else []
    evaluated = ", ".join(f"{what} {value}" for what, value in rows) or f"evaluation failed ({final.error})"
    version = model_registry.register_model(
        lineage,
        name,
        model_id,
        info.step,
        description=f"{config.run_name} at step {info.step}: {evaluated}",
        tags=tags,
        checkpoint_uri=info.checkpoint,
    )
    retention.protect_checkpoint(Run.of(config), info.step)
    gates = judge(config, lineage, final, name, version)
    alias = _apply_gates(config, lineage, name, version, gates)
    lineage.set_tags({"lmyard.gates": str({k: g.passed for k, g in gates.items()})})
    return RegisteredModel(
        name=name, version=version, alias=alias, gates=gates, source=info.checkpoint, model_uri=f"models:/{model_id}"
    )


def _apply_gates(config: RunConfig, lineage: Lineage, name: str, version: str, gates: dict[str, Gate]) -> str | None:
    """eval.alias on `version` when every gate passed and no approval is asked; the alias set, else None."""
    logger = get_run_logger()
    alias = None
    if not gates:
        logger.info(f"registered {name} version {version}; no eval.gates configured, so no {config.eval.alias!r} alias")
    elif all(g.passed for g in gates.values()):
        if config.eval.approval:
            logger.info(
                f"registered {name} version {version}: gates passed {gates}; {config.eval.alias!r} awaits approval"
            )
        else:
            model_registry.set_alias(lineage, name, config.eval.alias, version)
            alias = config.eval.alias
            logger.info(f"registered {name} version {version} as {alias!r}: gates passed {gates}")
    else:
        logger.warning(f"registered {name} version {version} without the {config.eval.alias!r} alias: gates {gates}")
    return alias


def judge(config: RunConfig, lineage: Lineage, final: Evaluation, name: str, version: str) -> dict[str, Gate]:
    """eval.gates on the final evaluation, else the lineage's latest logged metrics (a final evaluation that failed
    passes no gate); all passed: the event `lmyard.gates.passed` of version `version` of `name`."""
    if final.result is None:
        logged, result = {}, {}
    else:  # each metric's latest value, under the final evaluation's
        logged, result = lineage.client.get_run(lineage.ref.mlflow_run_id).data.metrics, final.result.metrics
    gates = {k: Gate(**g) for k, g in gate_results(config.eval.gates, result, logged).items()}
    if gates and all(g.passed for g in gates.values()):
        ref = lineage.ref
        links = {
            "model_uri": f"models:/{name}/{version}",
            "version_url": version_url(ref.tracking_uri, name, version),
            "run_url": run_url(ref.tracking_uri, ref.experiment_id, ref.mlflow_run_id),
            "flow_run_url": flow_run_url() or "",
        }
        _gates_passed(name, version, gates, links)
    return gates


def _gates_passed(name: str, version: str, gates: dict[str, Gate], links: dict[str, str]) -> None:
    """The event `lmyard.gates.passed`, related to this flow run and the tag `lmyard` (what automations match); its
    payload: the gates, the model's URI and the links a notification carries (`links`)."""
    related = [{"prefect.resource.id": "prefect.tag.lmyard", "prefect.resource.role": "tag"}]
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        run = ctx.flow_run
        related.append(
            {
                "prefect.resource.id": f"prefect.flow-run.{run.id}",
                "prefect.resource.role": "flow-run",
                "prefect.resource.name": run.name,
            }
        )
    emit_event(
        event="lmyard.gates.passed",
        resource={
            "prefect.resource.id": f"lmyard.model.{name}.{version}",
            "prefect.resource.name": f"{name} version {version}",
        },
        related=related,
        payload={
            "gates": {k: g.model_dump() for k, g in gates.items()},
            "values": ", ".join(
                f"{k} {g.value:.4g} (limit {g.limit:g})" for k, g in gates.items() if g.value is not None
            ),
            **links,
        },
    )


class Approval(RunInput):
    """What a person answers when a promotion waits (Prefect's UI renders it as a form)."""

    approve: bool = False
    note: str = ""


def approve_promotion(config: RunConfig, lineage: Lineage, model: RegisteredModel) -> RegisteredModel:
    """With eval.approval and every gate passed: pause the flow run (in its process) until a person resumes it
    with an Approval; approved: the version gets eval.alias. Refused, or no answer within
    eval.approval_timeout_s: it stays registered without the alias, and the run still completes."""
    logger = get_run_logger()
    if not (config.eval.approval and model.gates and all(g.passed for g in model.gates.values())):
        return model
    logger.info(
        f"{model.name} version {model.version} passed its gates; waiting up to {config.eval.approval_timeout_s} s "
        f"for approval of {config.eval.alias!r} (resume the flow run with approve: true)"
    )
    form = Approval.with_initial_data(description=review(config, lineage, model))  # what Prefect's form shows
    try:
        answer = pause_flow_run(wait_for_input=form, timeout=config.eval.approval_timeout_s, poll_interval=2)
    except FlowPauseTimeout:
        logger.warning(
            f"no approval within {config.eval.approval_timeout_s} s: {model.name} version {model.version} keeps no alias"
        )
        return model
    if not answer.approve:
        logger.warning(f"promotion of {model.name} version {model.version} refused: {answer.note or 'no reason given'}")
        return model
    return promote(lineage, model, config.eval.alias, answer.note)


def review(config: RunConfig, lineage: Lineage, model: RegisteredModel) -> str:
    """The approval form's description (markdown): the version and its source run (linked), its gates' values
    against their thresholds, and what approving does. Its links point at the lineage's own tracking server."""
    alias, ref = config.eval.alias, lineage.ref
    uri = ref.tracking_uri
    gates = "\n".join(
        f"| {k} | {'-' if g.value is None else f'{g.value:.4g}'} | {g.limit:g} | {'pass' if g.passed else 'FAIL'} |"
        for k, g in model.gates.items()
    )
    return (
        f"### Promote {model.name} version {model.version} to @{alias}?\n\n"
        f"- version: [models:/{model.name}/{model.version}]({version_url(uri, model.name, model.version)})\n"
        f"- source run: [{ref.mlflow_run_id}]({run_url(uri, ref.experiment_id, ref.mlflow_run_id)}) "
        f"(lineage {ref.run_name}), checkpoint `{model.source}`\n\n"
        f"| gate | value | threshold | |\n|---|---|---|---|\n{gates}\n\n"
        f"**Approve** sets the alias `{alias}` on version {model.version}: `models:/{model.name}@{alias}` then loads "
        f"it. Refused, or no answer within {config.eval.approval_timeout_s:g} s: the version stays registered "
        "without the alias. The note and the time of the answer become tags of the version."
    )


@task(name="promote-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def promote(lineage: Lineage, model: RegisteredModel, alias: str, note: str = "") -> RegisteredModel:
    """The approved version gets `alias`; the note and the time are tags of the version (and of the lineage's run)."""
    model_registry.set_alias(lineage, model.name, alias, model.version)
    approved_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    model_registry.tag_version(
        lineage, model.name, model.version, {"lmyard.approval.note": note, "lmyard.approval.approved_at": approved_at}
    )
    lineage.set_tags({"lmyard.promotion_approved": note or "approved"})
    get_run_logger().info(f"{model.name} version {model.version} is {alias!r}: approved")
    return model.model_copy(update={"alias": alias})


def _export(config: RunConfig, checkpoint_uri: str, folder: str) -> ExportResult:
    """The export stage (`python -m lmyard.stages export`, on config.launch.backend: torch stays out of the
    flow's process) into the local `folder`."""
    if backends.of(config).other_user:  # the stage image's user writes into this folder (bind-mounted)
        os.chmod(os.path.dirname(folder), 0o777)
    spec = ExportSpec(config=config, source=checkpoint_uri, dest=folder)
    return launch_stage(spec, get_run_logger().info)
