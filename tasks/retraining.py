"""Scheduled retraining: continue a lineage only when its data changed.

The decision compares the shard set the lineage's newest checkpoint was
trained on with the shard set of the data as it is now (content addresses):
- no checkpoint yet: train from scratch for `train.max_steps`;
- same address: nothing new, nothing to do;
- another address: continue from the newest checkpoint for `extra_steps` more
  steps on the new tokens (the trainer starts past the old data when the
  source only grew).
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.checkpoint import catalog
from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.run import Run
from tasks.results import RetrainDecision


@task(name="plan-retraining", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def plan_retraining(config: RunConfig, shards: ShardSet, extra_steps: int) -> RetrainDecision:
    """Train, continue on new data, or do nothing: compares the data with the newest checkpoint's."""
    decision = plan(config, shards, extra_steps)
    get_run_logger().info(f"retraining {config.run_name}: {decision.action} ({decision.reason})")
    return decision


def plan(config: RunConfig, shards: ShardSet, extra_steps: int) -> RetrainDecision:
    run = Run.of(config)
    steps = catalog.complete_steps(run)
    if not steps:
        return RetrainDecision(
            action="train",
            reason=f"lineage {config.run_name} has no checkpoint yet",
            max_steps=config.train.max_steps,
            from_step=0,
        )
    state = catalog.read_state(run, steps[-1])
    if state.shard_address == shards.address:
        return RetrainDecision(
            action="none",
            from_step=steps[-1],
            max_steps=steps[-1],
            reason=f"no new data: shard set {shards.address} is what step {steps[-1]} was trained on",
        )
    return RetrainDecision(
        action="continue",
        from_step=steps[-1],
        max_steps=steps[-1] + extra_steps,
        reason=f"new data: shard set {state.shard_address} -> {shards.address}; "
        f"{extra_steps} more steps from step {steps[-1]}",
    )


def with_max_steps(config: RunConfig, max_steps: int) -> RunConfig:
    return config.model_copy(update={"train": config.train.model_copy(update={"max_steps": max_steps})})
