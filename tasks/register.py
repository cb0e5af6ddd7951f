"""Register the final model in the MLflow model registry; alias it when the eval gates pass."""

from __future__ import annotations

import os
import tempfile

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.checkpoint import retention
from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.evaluate.gates import gate_results
from lmyard.run import Run
from lmyard.stages import ExportResult, ExportSpec
from lmyard.tracking import registry
from lmyard.tracking.lineage import Lineage
from tasks._common import launch_stage
from tasks.results import Evaluation, Gate, RegisteredModel


@task(name="register-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def register_model(config: RunConfig, shards: ShardSet, lineage: Lineage, final: Evaluation) -> RegisteredModel:
    """The final checkpoint exported to Hugging Face format and logged as an MLflow pyfunc model (weights in
    the artifact store), registered as a new version; eval.alias only if every gate passes (a final evaluation
    that failed passes none: the model is registered, without the alias)."""
    logger = get_run_logger()
    name = config.tracking.registered_model or config.run_name
    gates = {
        k: Gate(**g)
        for k, g in gate_results(config.eval.gates, final.result.metrics if final.result is not None else {}).items()
    }
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
        model_id = registry.log_hf_model(lineage, name, folder, info.step, params, tags)
        size_mb = sum(e.stat().st_size for e in os.scandir(folder)) / 1e6
        logger.info(
            f"exported {info.checkpoint} as {info.hf_architecture} ({size_mb:.1f} MB) and logged "
            f"it as MLflow model models:/{model_id}"
        )
    evaluated = f"val loss {final.result.val_loss:.4f}" if final.result else f"evaluation failed ({final.error})"
    version = registry.register_model(
        lineage,
        name,
        model_id,
        info.step,
        description=f"{config.run_name} at step {info.step}: {evaluated}",
        tags=tags,
        checkpoint_uri=info.checkpoint,
    )
    retention.protect_checkpoint(Run.of(config).store, config.run_name, info.step)
    alias = None
    if not gates:
        logger.info(f"registered {name} version {version}; no eval.gates configured, so no {config.eval.alias!r} alias")
    elif all(g.passed for g in gates.values()):
        registry.set_alias(lineage, name, config.eval.alias, version)
        alias = config.eval.alias
        logger.info(f"registered {name} version {version} as {alias!r}: gates passed {gates}")
    else:
        logger.warning(f"registered {name} version {version} without the {config.eval.alias!r} alias: gates {gates}")
    lineage.set_tags({"lmyard.gates": str({k: g.passed for k, g in gates.items()})})
    return RegisteredModel(
        name=name, version=version, alias=alias, gates=gates, source=info.checkpoint, model_uri=f"models:/{model_id}"
    )


def _export(config: RunConfig, checkpoint_uri: str, folder: str) -> ExportResult:
    """The export stage (`python -m lmyard.stages export`, on config.launch.backend: torch stays out of the
    flow's process) into the local `folder`."""
    if config.launch.backend == "docker":  # the stage image's user writes into this folder (bind-mounted)
        os.chmod(os.path.dirname(folder), 0o777)
    spec = ExportSpec(config=config, source=checkpoint_uri, dest=folder)
    return launch_stage(spec, get_run_logger().info)
