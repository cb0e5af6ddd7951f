"""The shard flow: tokenize-and-shard alone (`lmyard shard RECIPE`)."""

from __future__ import annotations

from prefect import flow

from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from tasks.shard import tokenize_and_shard


@flow(name="shard")
def shard(config: RunConfig = RunConfig()) -> ShardSet:
    """Token shards for config.data in config.store; reused when they exist."""
    return tokenize_and_shard(config)
