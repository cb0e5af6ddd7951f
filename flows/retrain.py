"""The retrain flow: continue a lineage on new data; a quick no-op when nothing changed."""

from __future__ import annotations

from prefect import flow

from flows.pretrain import pretrain
from lmyard.config import RunConfig
from lmyard.recipes import with_recipe
from tasks.results import RetrainDecision
from tasks.retraining import plan_retraining, with_max_steps
from tasks.shard import tokenize_and_shard


@flow(name="retrain")
def retrain(config: RunConfig = RunConfig(), extra_steps: int = 100, recipe: str | None = None) -> RetrainDecision:
    """Tokenize the data as it is now; train on it only if it changed since the newest checkpoint."""
    config = with_recipe(config, recipe)
    shards = tokenize_and_shard(config)
    decision = plan_retraining(config, shards, extra_steps)
    if decision.action == "none":
        return decision
    run = pretrain(config=with_max_steps(config, decision.max_steps))
    return decision.model_copy(update={"run": run})
