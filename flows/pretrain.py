"""The pretrain flow: tokenize-and-shard -> open lineage -> train (evaluating each checkpoint) -> register -> finish."""

from __future__ import annotations

from prefect import flow

from lmyard.config import RunConfig
from tasks.evaluate import evaluate_checkpoint, new_checkpoints
from tasks.finish import finish
from tasks.lineage import close_lineage, ended_status, leased, lineage_crashed, lineage_killed, open_lineage
from tasks.register import register_model
from tasks.retention import retain_checkpoints
from tasks.shard import tokenize_and_shard
from tasks.train import stop_training, train


@flow(name="pretrain", on_cancellation=[lineage_killed], on_crashed=[lineage_crashed])
@leased  # one run of a lineage at a time
def pretrain(config: RunConfig = RunConfig()) -> dict:
    """Pretrain a GPT on config.data; resumes the lineage config.run_name if it exists."""
    shards = tokenize_and_shard(config)
    lineage = open_lineage(config, shards)
    try:
        # training runs in a worker thread; each new checkpoint is evaluated meanwhile, in a process of its own
        training = train.with_options(retries=config.launch.retries).submit(config, shards, lineage)
        for step in new_checkpoints(config, lineage, training):
            evaluated = evaluate_checkpoint(config, shards, lineage, step, return_state=True)  # a failure does not stop training
            # retention waits for each evaluation; a store hiccup here only delays deletion, never stops training
            retain_checkpoints(config, step, evaluated.is_completed(), return_state=True)
        trained = training.result()
        final = evaluate_checkpoint(config, shards, lineage, trained["step"])
        retain_checkpoints(config, trained["step"], True, final=True, return_state=True)
        model = register_model(config, shards, lineage, final)
    except BaseException as exc:
        stop_training()
        close_lineage(lineage, ended_status(exc))
        raise
    return finish(config, shards, lineage, trained, final, model)
