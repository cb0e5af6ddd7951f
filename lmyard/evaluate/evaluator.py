"""The evaluator: every evaluation of lmyard.evaluate.registry that the run's `eval` enables, on one checkpoint.

    python -m lmyard.stages evaluate --spec spec.json     (an EvalSpec; see lmyard.stages)

Runs in its own process on its own device (`eval.device`: cpu, or a spare
GPU), independent of the trainer: it reads the checkpoint and the shards
from the store, so training keeps its devices to itself. The model is made
once; each evaluation gets it in a `Context` and returns its typed result,
whose `Score` (its spec's metrics, rows and samples) the stage's EvalResult
holds under the evaluation's name.
"""

from __future__ import annotations

import os
import time

import torch

from lmyard.checkpoint import catalog, resume
from lmyard.config import EvalConfig, RunConfig
from lmyard.data.shards import ShardSet
from lmyard.errors import UserError
from lmyard.evaluate import registry
from lmyard.evaluate.spec import Context
from lmyard.models.registry import model_from_checkpoint
from lmyard.run import Run
from lmyard.stages import EvalResult

# ---------------------------------------------------------------- one checkpoint


def device_for(e: EvalConfig) -> str:
    if e.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"eval.device is {e.device!r} but no GPU is visible; set eval.device=cpu")
        index = int(e.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"eval.device is {e.device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif e.threads:
        torch.set_num_threads(e.threads)
    return e.device


def evaluate_checkpoint(cfg: RunConfig, shards: ShardSet, step: int, run: Run | None = None) -> EvalResult:
    """Every evaluation of the registry that cfg.eval enables, on the checkpoint at `step` (of `run`, the handle
    of cfg's run, opened here when not given)."""
    t0 = time.perf_counter()
    device = device_for(cfg.eval)
    run = run or Run.of(cfg)
    # a private checkpoint cache: the trainer may be downloading the same checkpoint to resume
    ckpt = resume.load_step(run, step, os.path.join(run.cache, "eval"))
    ctx = Context(cfg, model_from_checkpoint(ckpt, device), ckpt, shards, device, run.cache)
    scores = {spec.name: spec.score(spec.run(ctx)) for spec in registry.enabled(cfg.eval)}
    return EvalResult(
        step=ckpt.step,
        checkpoint=ckpt.uri,
        tokens_seen=ckpt.state.tokens_seen,
        trainer_val_loss=ckpt.state.val_loss,
        device=device,
        scores=scores,
        eval_s=round(time.perf_counter() - t0, 3),
    )


def evaluate_latest(cfg: RunConfig, shards: ShardSet, step: int | None = None) -> EvalResult:
    """Evaluate checkpoint `step` of cfg.run_name, or its newest complete one."""
    run = Run.of(cfg)
    if step is None:
        steps = catalog.complete_steps(run)
        if not steps:
            raise UserError(
                f"run {cfg.run_name!r} has no complete checkpoint in {cfg.store}: train it first, or "
                "set run_name to a run that has one"
            )
        step = steps[-1]
    return evaluate_checkpoint(cfg, shards, step, run)
