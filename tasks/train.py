"""Launch the trainer on every node and follow it to the end."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from lmyard.config import RunConfig
from lmyard.launch import run_local
from lmyard.shards import ShardSet
from lmyard.tracking import Lineage
from tasks._common import not_a_user_error


# A failed launch (a dead node or container, a crashed rank) fails the task; the retry resumes from
# the newest complete checkpoint. The flow sets the count from config.launch.retries.
@task(name="train", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10, retry_condition_fn=not_a_user_error)
def train(config: RunConfig, shards: ShardSet, lineage: Lineage | None) -> dict:
    """Run torchrun with the trainer, here or in one container per node; resumes from the newest checkpoint."""
    logger = get_run_logger()
    spec = {"config": config.model_dump(mode="json"), "shards": shards.to_dict(),
            "lineage": lineage.to_dict() if lineage else None}
    if config.launch.backend == "docker":
        from lmyard.launch_docker import run_docker

        return run_docker(config, spec, on_line=logger.info, flow_run_id=flow_run.get_id())
    return run_local(config, spec, on_line=logger.info)
