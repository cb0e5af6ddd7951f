"""Tokenize a text source into token shards in the store (or reuse them): the shard stage, launched."""

from __future__ import annotations

from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from lmyard import console
from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.stages import ShardProgress, ShardSpec
from tasks._common import artifact_key, launch_stage, not_a_user_error


def _describe(p: ShardProgress) -> str:
    return (
        f"{p.documents:,} documents, {p.tokens:,} tokens tokenized, {p.shards} shards; "
        f"{p.docs_per_s:,.0f} docs/s, {p.tokens_per_s:,.0f} tokens/s"
    )


@task(
    name="tokenize-and-shard",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[10, 60],
    retry_condition_fn=not_a_user_error,
)
def tokenize_and_shard(config: RunConfig) -> ShardSet:
    """Token shards + manifest for config.data at their content address (`python -m lmyard.dispatch shard`)."""
    artifact_id: UUID = create_progress_artifact(  # type: ignore[assignment]  # a UUID when called from sync code
        0.0, key=artifact_key(config.run_name, "shard-progress"), description="tokenize-and-shard: starting"
    )

    def progress(p: ShardProgress) -> None:
        rates = f"{p.tokens_per_s:,.0f} tokens/s"
        console.progress("tokenize", 100.0 * (p.fraction or 0), 100.0 if p.fraction is not None else None, rates)
        if p.fraction is not None:  # a source of unknown size (hub) shows its rates in the log only
            update_progress_artifact(artifact_id, 100.0 * p.fraction, description=_describe(p))

    return launch_stage(ShardSpec(config=config), get_run_logger().info, on_progress=progress).shards
