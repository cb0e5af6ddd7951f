"""Register the final model in the MLflow model registry; alias it when the eval gates pass."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard import tracking
from lmyard.config import RunConfig
from lmyard.config import gate_results
from lmyard.shards import ShardSet
from lmyard.store import open_store


@task(name="register-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def register_model(config: RunConfig, shards: ShardSet, lineage: tracking.Lineage, final: dict) -> dict:
    """A registry version whose source is the final checkpoint's URI; eval.alias only if every gate passes."""
    logger = get_run_logger()
    name = config.tracking.registered_model or config.run_name
    gates = gate_results(config.eval.gates, final)
    descriptor = {"checkpoint": final["checkpoint"], "step": final["step"], "tokens_seen": final["tokens_seen"],
                  "val_loss": final["val_loss"], "tokenizer": config.tokenizer.model_dump(),
                  "model": config.model.model_dump(), "shard_address": shards.address,
                  "load": "lmyard.checkpoint: model.pt (torch.load weights_only=True) + state.json['model'] dims"}
    version = tracking.register_model(
        lineage, name, final["checkpoint"], final["step"],
        description=f"{config.run_name} at step {final['step']}: val loss {final['val_loss']:.4f}",
        tags={"lmyard.run_name": config.run_name, "lmyard.shard_address": shards.address}, descriptor=descriptor)
    tracking.protect_checkpoint(open_store(config.store), config.run_name, final["step"])
    alias = None
    if not gates:
        logger.info(f"registered {name} version {version}; no eval.gates configured, so no {config.eval.alias!r} alias")
    elif all(g["passed"] for g in gates.values()):
        tracking.set_alias(config.tracking.uri, name, config.eval.alias, version)
        alias = config.eval.alias
        logger.info(f"registered {name} version {version} as {alias!r}: gates passed {gates}")
    else:
        logger.warning(f"registered {name} version {version} without the {config.eval.alias!r} alias: gates {gates}")
    tracking.set_tags(lineage, {"lmyard.gates": str({k: g["passed"] for k, g in gates.items()})})
    return {"name": name, "version": version, "alias": alias, "gates": gates, "source": final["checkpoint"]}
