"""A sweep's side effects: its MLflow run (the trials' parent), its trials' runs, its table of trials."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from lmyard.config import RunConfig
from lmyard.sweep import driver, record
from tasks._common import not_a_user_error


@task(name="open-sweep", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=not_a_user_error)
def open_sweep(config: RunConfig, kind: str) -> str:
    """Create or reopen the sweep's MLflow run; its id is every trial's tracking.parent_run_id."""
    run_id = record.open_parent(config, kind)
    get_run_logger().info(f"sweep {config.run_name}: MLflow run {run_id}")
    return run_id


@task(name="pending-trials", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def pending_trials(config: RunConfig, plan: driver.Plan) -> list[dict]:
    """The trials whose lineage is not finished (nor stopped by the scheduler): those the sweep trains now."""
    left = driver.pending(config, plan)
    done = len(plan.trials) - len(left)
    get_run_logger().info(
        f"sweep {config.run_name}: {done} of {len(plan.trials)} trials done already, {len(left)} to train"
    )
    return left


@task(name="train-trial", cache_policy=NO_CACHE)
def train_trial(config: RunConfig, command: list[str], name: str) -> None:
    """One trial's `lmyard run` here, to its end (it retries a crash itself: launch.retries)."""
    get_run_logger().info(f"trial {name}: log in {driver.trial_log(config, name)}")
    driver.run_one(config, command, name)


@task(name="train-trials-on-ray", cache_policy=NO_CACHE)
def train_trials_on_ray(config: RunConfig, plan: driver.Plan, commands: dict[str, list[str]]) -> None:
    """The trials under Ray Tune on the cluster, its scheduler stopping the worst early."""
    get_run_logger().info(f"sweep {config.run_name}: {len(commands)} trial(s) on the Ray cluster")
    driver.run_on_ray(config, plan, commands)


@task(name="log-sweep", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def log_sweep(config: RunConfig, plan: driver.Plan, parent: str, n_vocab: int) -> driver.SweepResult:
    """The table of trials and a size sweep's power law on the sweep's run, which is then closed."""
    result = driver.summarize(config, plan, parent, n_vocab)
    record.close_parent(config, parent, "FINISHED")
    get_run_logger().info(f"sweep {config.run_name}: {result.summary}")
    return result


@task(name="close-sweep", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def close_sweep(config: RunConfig, parent: str, status: str) -> None:
    record.close_parent(config, parent, status)
