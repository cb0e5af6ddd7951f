"""Register the final model in the MLflow model registry; alias it when the eval gates pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.checkpoint import retention
from lmyard.config import RunConfig
from lmyard.contracts import ExportResult, read_stage_result
from lmyard.data.shards import ShardSet
from lmyard.evaluate.gates import gate_results
from lmyard.store import open_store
from lmyard.tracking import registry
from lmyard.tracking.lineage import Lineage


@task(name="register-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def register_model(config: RunConfig, shards: ShardSet, lineage: Lineage, final: dict) -> dict:
    """The final checkpoint exported to Hugging Face format and logged as an MLflow pyfunc model (weights in
    the artifact store), registered as a new version; eval.alias only if every gate passes."""
    logger = get_run_logger()
    name = config.tracking.registered_model or config.run_name
    gates = gate_results(config.eval.gates, final)
    with tempfile.TemporaryDirectory(prefix="lmyard-register-") as tmp:
        folder = os.path.join(tmp, "hf_model")  # its name in the logged model: artifacts/hf_model
        info = _export(final["checkpoint"], folder)
        params = {
            "checkpoint_uri": final["checkpoint"],
            "step": str(final["step"]),
            "tokens_seen": str(final["tokens_seen"]),
            "hf_architecture": info["hf_architecture"],
            "tokenizer": config.tokenizer.name,
            "shard_address": shards.address,
        }
        tags = {"lmyard.run_name": config.run_name, "lmyard.shard_address": shards.address}
        model_id = registry.log_hf_model(lineage, name, folder, final["step"], params, tags)
        size_mb = sum(e.stat().st_size for e in os.scandir(folder)) / 1e6
        logger.info(
            f"exported {final['checkpoint']} as {info['hf_architecture']} ({size_mb:.1f} MB) and logged "
            f"it as MLflow model models:/{model_id}"
        )
    version = registry.register_model(
        lineage,
        name,
        model_id,
        final["step"],
        description=f"{config.run_name} at step {final['step']}: val loss {final['val_loss']:.4f}",
        tags=tags,
        checkpoint_uri=final["checkpoint"],
    )
    retention.protect_checkpoint(open_store(config.store), config.run_name, final["step"])
    alias = None
    if not gates:
        logger.info(f"registered {name} version {version}; no eval.gates configured, so no {config.eval.alias!r} alias")
    elif all(g["passed"] for g in gates.values()):
        registry.set_alias(lineage, name, config.eval.alias, version)
        alias = config.eval.alias
        logger.info(f"registered {name} version {version} as {alias!r}: gates passed {gates}")
    else:
        logger.warning(f"registered {name} version {version} without the {config.eval.alias!r} alias: gates {gates}")
    lineage.set_tags({"lmyard.gates": str({k: g["passed"] for k, g in gates.items()})})
    return {
        "name": name,
        "version": version,
        "alias": alias,
        "gates": gates,
        "source": final["checkpoint"],
        "model_uri": f"models:/{model_id}",
    }


def _export(checkpoint_uri: str, folder: str) -> dict:
    """`python -m lmyard.export` in a process of its own (torch stays out of the flow's process); the
    ExportResult it writes to a file (lmyard_export.json's fields and the folder's URI)."""
    out = os.path.join(folder + ".result", "result.json")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lmyard.export", checkpoint_uri, "--to", folder, "--out", out],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        return read_stage_result(out, ExportResult, proc.returncode, tail).model_dump()
    finally:
        shutil.rmtree(folder + ".result", ignore_errors=True)
