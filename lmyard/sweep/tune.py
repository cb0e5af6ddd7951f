"""Trials on a Ray cluster under Ray Tune: each trial is an actor that runs and watches one `lmyard run`
(lmyard.sweep.runner); the trial's trainer takes the cluster's resources through its own placement group
(launch.backend=ray), so the actor asks for no CPU (one byte of memory: Tune wants something), and as many trials run at once as the cluster's CPUs hold.
A scheduler (ASHA) reads each trial's val loss at its steps and stops the worst early; a stopped trial's
process gets SIGTERM (the flow checkpoints and closes its lineage) and is waited for.

The actors get the sweep process's PREFECT_API_URL, LMYARD_* (not secrets), MLFLOW_TRACKING_URI, PYTHONPATH and
TIKTOKEN_CACHE_DIR through Ray's runtime_env, which Ray records: credentials come from the nodes' own environment.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.launch import ray as ray_launch
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.sweep.runner import TrialProcess
from lmyard.sweep.space import Schedule

PASSED = (
    "PREFECT_API_URL",
    "LMYARD_CACHE",
    "LMYARD_STORE",
    "MLFLOW_TRACKING_URI",
    "PYTHONPATH",
    "TIKTOKEN_CACHE_DIR",
    *ray_launch.QUIET_ENV,
)


def _connect(cfg: RunConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {k: v for k, v in os.environ.items() if k in PASSED or k == "LMYARD_TRACKING__URI"}
    ray_launch.quiet_driver()
    ray.init(
        address=ray_launch.address(cfg),
        namespace=ray_launch.NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": env},
    )
    # the trials' own `lmyard run` reaches the same cluster, whatever the nodes' RAY_ADDRESS
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def prefect_unreachable(api_url: str | None, here: set[str], nodes: list[dict]) -> str | None:
    """Why trials on the cluster's other hosts cannot reach the sweep's Prefect API (a loopback PREFECT_API_URL,
    this machine's, and live nodes at addresses not in `here`, this machine's); None when they can."""
    host = urlsplit(api_url).hostname if api_url else None
    if host is not None and host != "localhost" and not host.startswith("127.") and host != "::1":
        return None
    others = sorted({n["NodeManagerAddress"] for n in nodes if n.get("Alive") and n["NodeManagerAddress"] not in here})
    if not others:
        return None
    said = api_url or "is unset (lmyard's temporary server on 127.0.0.1)"
    return (
        f"PREFECT_API_URL {said}: the sweep's trials on the Ray cluster's other hosts ({', '.join(others)}) cannot "
        "reach this machine's loopback; set PREFECT_API_URL to a Prefect server every node reaches "
        "(docs/sweeps.md), or sweep on a one-host cluster"
    )


def _local_addresses() -> set[str]:
    """This machine's addresses, every interface's (loopback included)."""
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.address}


def check_cluster(cfg: RunConfig, trials: dict[str, RunConfig], api_url: str | None) -> None:
    """Before anything is made: the trials reach the sweep's Prefect API (`api_url`; None: a temporary server on
    this machine), and the cluster can place each trial's training (lmyard.launch.ray_requests); a UserError
    naming PREFECT_API_URL, or the trial and its keys. A connection made here is closed: the sweep's own
    connects with the environment its trials get."""
    import ray

    from lmyard.launch.ray_requests import train_request, unfit

    connected = ray.is_initialized()
    _connect(cfg)
    try:
        nodes = ray.nodes()
    finally:
        if not connected:
            ray.shutdown()
    if why := prefect_unreachable(api_url, _local_addresses(), nodes):
        raise UserError(why)
    for name, trial in trials.items():
        if why := unfit(train_request(trial), trial.launch.nnodes, nodes):
            raise UserError(
                f"trial {name}: the Ray cluster can never place its training: {why} (one bundle per node); lower "
                "launch.nnodes or launch.nproc_per_node, launch.ray.cpus_per_node/gpus_per_node/resources"
            )


def _trainable():
    from ray import tune

    class Trial(tune.Trainable):
        """One trial: its `lmyard run` started in setup, a result for each val loss it logs, stopped in cleanup."""

        def setup(self, config: dict[str, Any]) -> None:
            t = config["trial"]
            env = {"RAY_ADDRESS": t["ray_address"]}
            trial = Run(t["name"], open_store(t["store"]))
            self.proc = TrialProcess(trial, t["command"], Path(t["log"]), t["tracking_uri"], env)
            self.points, self.last, self.grace_s = self.proc.points(), (0, float("nan")), float(t["grace_s"])

        def step(self) -> dict[str, Any]:
            try:
                self.last = next(self.points)
            except StopIteration:  # the run ended: its last point again, done (Tune sets done on a stop too)
                return {"step": self.last[0], "val_loss": self.last[1], "done": True, "ended": True}
            return {"step": self.last[0], "val_loss": self.last[1]}

        def save_checkpoint(self, checkpoint_dir: str) -> dict:
            return {}  # the trial's lineage holds its checkpoints; its rerun resumes from them

        def load_checkpoint(self, checkpoint: dict | None) -> None:
            pass

        def cleanup(self) -> None:
            self.proc.stop(self.grace_s)  # a stopped trial checkpoints and closes its lineage; an ended one: no-op

    return Trial


def run_on_ray(
    cfg: RunConfig, trials: list[dict[str, Any]], schedule: Schedule | None, storage: Path
) -> dict[str, tuple[str, int | None, int]]:
    """Run the trials (their names, commands, logs) under Tune; name -> (error, stopped at, exit code): the
    error's last line ('' if none), the step at which the scheduler stopped the trial (None if it ran to its end
    or failed), and the trial's exit code (2: a user error, 1: any other failure, 0: none).

    The step is the scheduler's decision, at a rung: a trial's process may run on past it until its SIGTERM
    lands (a tiny trial can reach its last step first)."""
    import ray
    from ray import tune

    _connect(cfg)
    address = ray.get_runtime_context().gcs_address
    per_trial = cfg.launch.nnodes * (cfg.launch.ray.cpus_per_node or cfg.launch.nproc_per_node)
    at_once = max(1, int(ray.cluster_resources().get("CPU", 1) // per_trial))
    scheduler = _scheduler(cfg, schedule)
    grace_s = cfg.launch.grace_s + 120  # the flow's checkpoint, then its lineage closed
    space = [{**t, "ray_address": address, "grace_s": grace_s} for t in trials]
    tuner = tune.Tuner(
        tune.with_resources(_trainable(), {"cpu": 0, "memory": 1}),  # no CPU: the trainer takes them
        param_space={"trial": tune.grid_search(space)},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", scheduler=scheduler, max_concurrent_trials=at_once),
        run_config=tune.RunConfig(
            name=cfg.run_name,
            storage_path=str(storage),
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),  # a trial's crash is retried by its own flow
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),
        ),
    )
    controller = logging.getLogger("ray.tune.execution.tune_controller")  # its traceback of each failed trial
    controller.addFilter(said_by_the_sweep := _TrialFailures())
    try:
        results = tuner.fit()
    finally:
        controller.removeFilter(said_by_the_sweep)
    return _outcomes(results)


def _scheduler(cfg: RunConfig, schedule: Schedule | None):
    """ASHA at the schedule's rungs (by step), or every trial to its end (FIFO)."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if not schedule:
        return FIFOScheduler()
    return ASHAScheduler(
        time_attr="step",
        max_t=cfg.train.max_steps + 1,  # never stop a trial for reaching its end: it finishes its flow
        grace_period=schedule.grace_steps,
        reduction_factor=schedule.reduction_factor,
    )


def _outcomes(results) -> dict[str, tuple[str, int | None, int]]:
    """Tune's results as run_on_ray returns them: name -> (error's last line, stopped at, exit code)."""
    out = {}
    for i in range(len(results)):
        r = results[i]
        error = str(r.error).strip().splitlines()[-1] if r.error else ""
        code = int(getattr(getattr(r.error, "cause", None) or r.error, "exit_code", 1)) if r.error else 0
        metrics = r.metrics or {}
        stopped = None if error or metrics.get("ended") else int(metrics.get("step", 0))
        out[(r.config or {})["trial"]["name"]] = (error, stopped, code)
    return out


class _TrialFailures(logging.Filter):
    """Tune's error record (with the remote traceback) of a failed trial: the sweep says each in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Trial task failed for trial")
