"""A sweep from start to end, in the order the sweep flow (flows/sweep.py) calls it: the plan (trials and their
configs, every mistake one line before anything trains), the trials that are not done yet (run one after another
on the local backend, under Ray Tune on a cluster), and the summary on the sweep's MLflow run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from lmyard import backends
from lmyard.config import RunConfig
from lmyard.errors import ExitCode, UserError
from lmyard.paths import cache_root
from lmyard.run import Run
from lmyard.sweep import record
from lmyard.sweep.runner import TrialFailed, TrialProcess
from lmyard.sweep.space import (
    TOKENS_PER_PARAM,
    Schedule,
    Trial,
    absolute_uri,
    isoflop_trials,
    parse_space,
    said,
    search_trials,
    size_trials,
    trial_config,
)

log = logging.getLogger("lmyard.sweep")


class Plan(BaseModel):
    """The trials of a sweep: each one's name, overrides, scaling index and whole (explicit) config."""

    kind: str  # sizes, isoflop (sizes at compute budgets) or search
    trials: list[dict[str, Any]]
    schedule: dict[str, Any] | None = None

    def schedule_(self) -> Schedule | None:
        return Schedule(**self.schedule) if self.schedule else None


class SweepResult(BaseModel):
    """What a sweep ended with: its MLflow run, every trial's row of the table, the power law of a size sweep."""

    run_name: str
    mlflow_run_id: str
    rows: list[dict[str, Any]]
    summary: str
    recommended: list[str] = []  # an isoFLOP sweep's lines: each budget's compute-optimal size, the power law


def plan(
    config: RunConfig,
    sizes: list[int] | None,
    search: dict[str, Any] | None,
    source: str = "",
    budgets: list[float] | None = None,
    tokens_per_param: float | None = None,
) -> Plan:
    """The trials, each config validated; UserError for a bad space or a trial config that cannot work. With
    `budgets`, an isoFLOP sweep (lmyard.sweep.isoflop): each budget's own sizes around the N that trains on
    `tokens_per_param` tokens a parameter (Chinchilla's optimum, 20, by default), or with `sizes` every one of them
    at every budget."""
    if search is not None and (sizes is not None or budgets is not None):
        raise UserError("--search goes alone: a search space, or --sizes and/or --budgets (model sizes)")
    if sizes is None and search is None and budgets is None:
        raise UserError("a sweep takes --sizes 1,2,3 (model sizes), --budgets 1e15,3e15,1e16 (an isoFLOP sweep) "
                        "or --search FILE (a search space)")  # fmt: skip
    if tokens_per_param is not None and (budgets is None or sizes is not None):
        raise UserError("--tokens-per-param centres each budget's own sizes: give it with --budgets, without --sizes")
    schedule = None
    if budgets is not None:
        from lmyard.data.tokenizer import get_tokenizer

        n_vocab = get_tokenizer(config.tokenizer).n_vocab
        trials = isoflop_trials(config, sizes, budgets, n_vocab, tokens_per_param or TOKENS_PER_PARAM)
    elif sizes is not None:
        trials = size_trials(config, sizes)
    else:
        space = parse_space(search, source or "search space")
        trials, schedule = search_trials(config, space), space.schedule
    vocab: dict[str, int] = {}
    gpu_bytes = local_gpu_bytes() if backends.of(config).on_flow_host else None
    for t in trials:  # every trial's config valid, fitting the disks and the GPUs, before the shards are made
        cfg = RunConfig.model_validate(trial_config(config, t))
        _check_disks(cfg, t, vocab)
        _check_memory(cfg, t, vocab, gpu_bytes)
    rows = [{"name": t.name, "overrides": t.overrides, "size": t.size, "budget": t.budget} for t in trials]
    kind = "isoflop" if budgets is not None else "search" if sizes is None else "sizes"
    return Plan(kind=kind, trials=rows, schedule=schedule and vars(schedule))


def _check_disks(cfg: RunConfig, trial: Trial, vocab: dict[str, int]) -> None:
    """The trial's checkpoints fit this node's disks (lmyard.checkpoint.budget, as its trainer checks before its
    first step): a UserError naming the trial and its keys when they cannot. `vocab`: n_vocab by tokenizer."""
    from lmyard.checkpoint import budget
    from lmyard.data.tokenizer import get_tokenizer
    from lmyard.models import registry

    if cfg.model.init_from:  # its sizes are those of a model not read yet: its trainer checks them
        return
    key = cfg.tokenizer.model_dump_json()
    n_vocab = vocab[key] = vocab.get(key) or get_tokenizer(cfg.tokenizer).n_vocab
    fields = {"arch": cfg.model.architecture(), **registry.resolve(cfg.model, n_vocab)}
    try:
        budget.check(cfg, Run.of(cfg), fields, node_share=1.0)
    except UserError as e:
        raise UserError(f"trial {trial.name} ({said(trial.overrides)}): {e}") from None


def _check_memory(cfg: RunConfig, trial: Trial, vocab: dict[str, int], gpu_bytes: int | None) -> None:
    """The trial's step fits each of this machine's GPUs (lmyard.train.distributed.memory, the plan its trainer
    makes before its first step): a UserError naming the trial and what would fit when nothing does. Nothing to
    plan on CPU (`gpu_bytes` None), for a Hugging Face folder's model, or on a cluster (each trainer plans)."""
    from lmyard.train.distributed import memory

    if gpu_bytes is None or cfg.model.init_from or cfg.train.device == "cpu":
        return
    key = cfg.tokenizer.model_dump_json()
    n_vocab = vocab.get(key) or 50257  # _check_disks filled it
    try:
        train, _ = memory.resolve(cfg.model, cfg.train, cfg.world_size(), gpu_bytes, n_vocab)
        memory.check(memory.estimate(cfg.model, train, cfg.world_size(), gpu_bytes, n_vocab))
    except UserError as e:
        raise UserError(f"trial {trial.name} ({said(trial.overrides)}): {e}") from None


def local_gpu_bytes() -> int | None:
    """The smallest GPU's memory on this machine (nvidia-smi, no torch in the flow's process); None without one."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout  # fmt: skip
        mib = [int(x) for x in out.split() if x.strip().isdigit()]
    except (OSError, subprocess.SubprocessError):
        return None
    return min(mib) << 20 if mib else None


def check_cluster(config: RunConfig, p: Plan, api_url: str | None) -> None:
    """On the Ray backend, before anything is made: the cluster places every trial's training and its trials
    reach the Prefect API `api_url` (lmyard.sweep.tune.check_cluster); nothing to check on the local backend."""
    if not backends.of(config).on_ray:
        return
    from lmyard.sweep.tune import check_cluster as on_ray

    trials = {row["name"]: RunConfig.model_validate(trial_config(config, _trial(row))) for row in p.trials}
    on_ray(config, trials, api_url)


def _trial(row: dict[str, Any]) -> Trial:
    return Trial(row["name"], row["overrides"], row["size"], row.get("budget"))


def pending(config: RunConfig, p: Plan) -> list[dict[str, Any]]:
    """The trials not done yet: a finished or stopped trial's lineage is not trained again."""
    store = Run.of(config).store
    return [row for row in p.trials if not record.done(record.outcome(config, Run(row["name"], store)))]


def trial_log(config: RunConfig, name: str) -> Path:
    return Path(cache_root("sweeps", config.run_name, f"{name}.log"))


def run_one(config: RunConfig, command: list[str], name: str) -> None:
    """One trial's `lmyard run` to its end, here (the local backend); TrialFailed if it failed."""
    trial = Run(name, Run.of(config).store)
    proc = TrialProcess(trial, command, trial_log(config, name), config.tracking.uri, {})
    try:
        for step, loss in proc.points():
            log.info(f"trial {name}: val loss {loss:.4f} at step {step}")
    finally:
        proc.stop(config.launch.grace_s + 120)  # only an interrupted sweep finds it running


def run_on_ray(config: RunConfig, p: Plan, commands: dict[str, list[str]]) -> None:
    """The pending trials under Ray Tune; trials the scheduler stopped are tagged done; TrialFailed for any that
    failed (after the others ended)."""
    from lmyard.sweep.tune import run_on_ray as tune_run

    rows = [
        {
            "name": n,
            "command": c,
            "log": str(trial_log(config, n)),
            "tracking_uri": absolute_uri(config.tracking.uri),
            "store": absolute_uri(config.store),
        }
        for n, c in commands.items()
    ]
    ends = tune_run(config, rows, p.schedule_(), Path(cache_root("sweeps", "tune")))
    store = Run.of(config).store
    for name, (_, stopped_at, _) in ends.items():
        if stopped_at is not None:
            record.mark_stopped(config, Run(name, store), stopped_at)
    failed = {n: (e, code) for n, (e, _, code) in ends.items() if e}
    for e, _ in failed.values():
        log.error(e)  # one line each: the trial's own (its name, exit code, last line, log)
    if failed:
        user = all(code == ExitCode.USER_ERROR for _, code in failed.values())
        raise TrialFailed(
            f"{len(failed)} of {len(ends)} trial(s) failed: {', '.join(failed)} (each said above)",
            ExitCode.USER_ERROR if user else ExitCode.CRASHED,
        )


def summarize(config: RunConfig, p: Plan, parent: str, n_vocab: int) -> SweepResult:
    """The table of trials and (sizes) the fitted power law, logged on the sweep's run."""
    store, rows = Run.of(config).store, []
    for row in p.trials:
        o = record.outcome(config, Run(row["name"], store))
        n, d, flops = record.compute(trial_config(config, _trial(row)), n_vocab, o.step)
        rows.append(
            {
                "trial": o.name,
                "status": o.status,
                "size": row["size"],
                **({"budget": row["budget"]} if row.get("budget") else {}),
                **{f"set.{k}": v for k, v in row["overrides"].items()},
            }
            | {
                "step": o.step,
                "val_loss": o.val_loss,
                "params": n,
                "tokens": d,
                "flops": flops,
                "mlflow_run_id": o.run_id,
            }
        )
    said = record.log_summary(config, parent, rows, p.kind)
    recommended = said.splitlines()[1:] if p.kind == "isoflop" else []
    return SweepResult(run_name=config.run_name, mlflow_run_id=parent, rows=rows, summary=said, recommended=recommended)
