"""The pretrain flow: tokenize-and-shard -> open lineage -> train (checkpoint, evaluate, retain each step) ->
register (-> approval; not with tracking.registry=false) -> finish."""

from __future__ import annotations

from prefect import flow

from lmyard.config import RunConfig
from lmyard.evaluate.harness import check_tasks
from lmyard.recipes import with_recipe
from lmyard.tracking.credentials import credentials_to_env
from lmyard.tracking.quiet import quiet_mlflow
from lmyard.tracking.registered import check as check_registered
from lmyard.tracking.registered import is_registered
from tasks.checkpoint import record_checkpoint
from tasks.evaluate import evaluate_checkpoint, new_checkpoints
from tasks.finish import finish
from tasks.lineage import close_lineage, ended_status, lineage_crashed, lineage_killed, lineage_lease, open_lineage
from tasks.register import approve_promotion, register_model
from tasks.results import RunSummary
from tasks.retention import retain_checkpoints
from tasks.shard import tokenize_and_shard
from tasks.train import stop_training, train


@flow(name="pretrain", on_cancellation=[lineage_killed], on_crashed=[lineage_crashed])
def pretrain(config: RunConfig = RunConfig(), recipe: str | None = None) -> RunSummary:
    """Pretrain a GPT on config.data; resumes the lineage config.run_name if it exists.

    `recipe` (a recipe's name, lmyard.recipes): its config, with `config`'s explicitly set fields on top."""
    config = credentials_to_env(with_recipe(config, recipe))  # the tracking password: environment only
    quiet_mlflow()  # MLflow's INFO lines and download bars, under a worker as under `lmyard run`
    check_tasks(config.eval)  # an lm-eval task that cannot load would fail every evaluation, after all the training
    if is_registered(config.model.init_from):  # a registered model that is not there: one line, before anything
        check_registered(str(config.model.init_from), config.tracking.uri)
    with lineage_lease(config) as held:  # one run writes a lineage at a time; others wait, then refuse
        shards = tokenize_and_shard(config)
        lineage = open_lineage(config, shards)
        try:
            # training runs in a worker thread; each new checkpoint is verified and evaluated meanwhile
            training = train.with_options(retries=config.launch.retries).submit(config, shards, lineage, held.ref)
            evaluations = []  # a failed evaluation is recorded in it and on the MLflow run; it never stops training
            for step in new_checkpoints(config, lineage, training):
                held.check()  # LeaseLost once another run holds the lineage: this one writes nothing further
                record_checkpoint(config, lineage, step, return_state=True)  # a failure does not stop training
                evaluations.append(evaluate_checkpoint(config, shards, lineage, step))
                # retention waits for each evaluation; a store hiccup only delays deletion, never stops training
                retain_checkpoints(config, step, evaluations[-1].ok, return_state=True)
            trained = training.result()
            held.check()
            record_checkpoint(config, lineage, trained.step, return_state=True)
            evaluations.append(final := evaluate_checkpoint(config, shards, lineage, trained.step))
            retain_checkpoints(config, trained.step, True, final=True, return_state=True)
            held.check()
            model = (
                approve_promotion(config, lineage, register_model(config, shards, lineage, final))
                if config.tracking.registry
                else None
            )
        except BaseException as exc:
            stop_training(config)  # waits for the trainers' end: the lease is released after it
            close_lineage(lineage, ended_status(exc))
            raise
        return finish(config, shards, lineage, trained, evaluations, model)
