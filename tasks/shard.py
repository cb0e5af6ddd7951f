"""Tokenize a text source into token shards in the store (or reuse them)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard import sharding
from lmyard.config import RunConfig
from lmyard.shards import ShardSet
from tasks._common import not_a_user_error


@task(name="tokenize-and-shard", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[10, 60],
      retry_condition_fn=not_a_user_error)
def tokenize_and_shard(config: RunConfig) -> ShardSet:
    """Token shards + manifest for config.data at their content address."""
    shards, _reused = sharding.tokenize_and_shard(config, log=get_run_logger().info)
    return shards
