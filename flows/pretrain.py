"""The pretrain flow: tokenize-and-shard -> open lineage -> train -> evaluate -> finish."""

from __future__ import annotations

from prefect import flow

from lmyard.config import RunConfig
from tasks.evaluate import evaluate
from tasks.finish import finish
from tasks.lineage import close_lineage, open_lineage
from tasks.shard import tokenize_and_shard
from tasks.train import train


@flow(name="pretrain")
def pretrain(config: RunConfig = RunConfig()) -> dict:
    """Pretrain a GPT on config.data; resumes the lineage config.run_name if it exists."""
    shards = tokenize_and_shard(config)
    lineage = open_lineage(config, shards)
    try:
        trained = train.with_options(retries=config.launch.retries)(config, shards, lineage)
        evaluation = evaluate(config, shards, lineage)
    except BaseException as exc:
        close_lineage(lineage, "KILLED" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "FAILED")
        raise
    return finish(config, shards, lineage, trained, evaluation)
