"""Launch the trainer on every node and follow it to the end."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.launch import run_local
from lmyard.shards import ShardSet
from lmyard.tracking import Lineage
from tasks._common import not_a_user_error


@task(name="train", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, retry_condition_fn=not_a_user_error)
def train(config: RunConfig, shards: ShardSet, lineage: Lineage) -> dict:
    """Run torchrun with the trainer; resumes from the newest complete checkpoint."""
    logger = get_run_logger()
    spec = {"config": config.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": lineage.to_dict()}
    if config.launch.backend != "local":
        raise UserError(f"launch.backend {config.launch.backend!r} is not available in this version; use `local`")
    return run_local(config, spec, on_line=logger.info)
