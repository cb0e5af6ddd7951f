"""The sweep flow: one recipe trained as many lineages, a family of sizes or a search space (docs/sweeps.md).

plan (every trial's config checked) -> tokenize-and-shard once -> the sweep's MLflow run ->
the trials not done yet (`lmyard run` each: one after another here, under Ray Tune on a cluster) -> the table
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow
from prefect.settings import PREFECT_API_URL

from lmyard import backends
from lmyard.config import RunConfig
from lmyard.recipes import with_recipe
from lmyard.sweep.driver import SweepResult, check_cluster, plan
from lmyard.sweep.space import Trial, assignments, trial_config
from lmyard.tracking.credentials import credentials_to_env
from lmyard.tracking.quiet import quiet_mlflow
from tasks.lineage import ended_status
from tasks.shard import tokenize_and_shard
from tasks.sweep import close_sweep, log_sweep, open_sweep, pending_trials, train_trial, train_trials_on_ray


def trial_command(config: RunConfig, trial: dict[str, Any], parent: str) -> list[str]:
    """The trial's ordinary `lmyard run`: every field it sets, its run name, its parent run."""
    data = trial_config(config, Trial(trial["name"], trial["overrides"], trial["size"]), parent)
    return [sys.executable, "-m", "flows.cli", "run", "smoke", *(a for s in assignments(data) for a in ("--set", s))]


@flow(name="sweep")
def sweep(
    config: RunConfig = RunConfig(),
    recipe: str | None = None,
    sizes: list[int] | None = None,
    search: dict[str, Any] | None = None,
    budgets: list[float] | None = None,
    tokens_per_param: float | None = None,
) -> SweepResult:
    """Train `recipe` (with `config`'s fields on top) at scaling indices `sizes`, at compute budgets `budgets` (an
    isoFLOP sweep: each budget's own sizes, centred on `tokens_per_param` tokens a parameter, or every one of
    `sizes`), or over the search space `search`
    (docs/sweeps.md); a rerun trains only the trials that are not done."""
    config = credentials_to_env(with_recipe(config, recipe))
    quiet_mlflow()  # MLflow's INFO lines and download bars, under a worker as under `lmyard run`
    # a bad space or trial: one line, before anything
    trials = plan(config, sizes, search, budgets=budgets, tokens_per_param=tokens_per_param)
    check_cluster(config, trials, PREFECT_API_URL.value())  # Ray: each trial placed, the Prefect API reached
    shards = tokenize_and_shard(config)  # once: every trial of the same data reuses this shard set
    parent = open_sweep(config, trials.kind)
    commands = {t["name"]: trial_command(config, t, parent) for t in pending_trials(config, trials)}
    try:
        if backends.of(config).on_ray:
            train_trials_on_ray(config, trials, commands)
        else:
            for name, command in commands.items():
                train_trial(config, command, name)
    except BaseException as exc:
        close_sweep(config, parent, ended_status(exc) or "FAILED")  # KILLED on an interrupt, as `lmyard run`'s
        raise
    return log_sweep(config, trials, parent, shards.n_vocab)
