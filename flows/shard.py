"""The shard flow: tokenize-and-shard alone (`lmyard shard RECIPE`)."""

from __future__ import annotations

from prefect import flow

from lmyard.config import RunConfig
from tasks.shard import tokenize_and_shard


@flow(name="shard")
def shard(config: RunConfig = RunConfig()) -> dict:
    """Token shards for config.data in config.store; reused when they exist."""
    return tokenize_and_shard(config).to_dict()
