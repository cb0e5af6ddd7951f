"""Decide what a scheduled retraining run does."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.config import RunConfig
from lmyard.contracts import RetrainDecision, ShardSet
from lmyard.train import retraining


@task(name="plan-retraining", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def plan_retraining(config: RunConfig, shards: ShardSet, extra_steps: int) -> RetrainDecision:
    """Train, continue on new data, or do nothing: compares the data with the newest checkpoint's."""
    decision = retraining.plan(config, shards, extra_steps)
    get_run_logger().info(f"retraining {config.run_name}: {decision.action} ({decision.reason})")
    return decision
