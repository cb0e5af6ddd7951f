"""The training loop on every rank: `Trainer.train()`, run by the train stage (lmyard.train.stage).

`Trainer.train()` reads top to bottom: resume -> loop { step -> guard -> log -> validate -> checkpoint ->
faults -> preemption }, each component deciding when it is due (lmyard.train.components). Checkpoints go
through one door, the `CheckpointManager` (lmyard.checkpoint.manager: load, save, the rollback target, flush,
close), and the strategy (lmyard.train.distributed.Parallelism: shard, wrap) decides how the model spreads
over the ranks. It resumes from the newest complete checkpoint of `runs/<run_name>` exactly: weights, AdamW
state, step, data cursor and every rank's RNG state (Python's, numpy's and torch's, all seeded at the start).
Imports stay light (no mlflow or boto3 until used) so the entrypoint starts fast.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from lmyard.checkpoint.manager import CheckpointManager, Loaded
from lmyard.config import TrainConfig
from lmyard.data.loader import Prefetcher
from lmyard.errors import Diverged, ExitCode, Preempted, StoreOutage
from lmyard.evaluate.validation import val_loss
from lmyard.models.registry import flops_per_token, model_spec, resolve
from lmyard.run import Run
from lmyard.stages import Exchange, Heartbeat, Started, TrainResult, TrainSpec
from lmyard.tracking.lease import Fence
from lmyard.tracking.sink import MetricsSink
from lmyard.train import build
from lmyard.train.compile_cache import CompileCache
from lmyard.train.components import (
    Checkpointing,
    DivergenceGuard,
    FaultHook,
    Goodput,
    MetricsLogger,
    Preemption,
    Startup,
    Validator,
    all_mean,
)
from lmyard.train.distributed import Dist, Parallelism, no_sync, plan_memory
from lmyard.train.optim import clipped_update

# How long a checkpoint waits for the metrics logged so far to reach MLflow (lmyard.tracking.sink.MLflowSink.flush);
# a hung MLflow is waited for once, not at every checkpoint, and the sink resends when it can.
CHECKPOINT_FLUSH_S = 5.0


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to t.lr over warmup_steps, then (train.schedule) cosine decay to lr * min_lr_ratio at
    max_steps, or wsd: the peak held, then a linear decay to lr * min_lr_ratio over the last decay_fraction of
    the steps after warmup. A function of the step and the config alone: a resume under another schedule (or
    max_steps) follows the new one from the checkpoint's step on."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    if t.schedule == "wsd":
        coeff = min(1.0, (1.0 - min(1.0, progress)) / t.decay_fraction)
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * coeff)


class Trainer:
    """One run of the loop on this rank. `train()` only delegates; the components decide what is due."""

    def __init__(
        self,
        spec: TrainSpec,
        run: Run,
        d: Dist,
        sink: MetricsSink,
        fence: Fence | None = None,
        startup: Startup | None = None,
    ):
        self.startup = startup or Startup()  # the restart to the first step, in parts (made at the stage's entry)
        cfg, shards, lineage = spec.config, spec.shards, spec.lineage
        self.cfg, self.t, self.shards, self.lineage, self.d, self.sink = cfg, cfg.train, shards, lineage, d, sink
        self.run, self.cache = run, run.cache
        self.fence = fence  # the lineage's lease (lmyard.tracking.lease)
        self.exchange = Exchange.from_env() if d.is_main else None
        build.seed_everything(self.t.seed, d.rank)
        self.parallel = Parallelism.of(cfg)  # chosen once: the trainer never asks train.parallel again
        if not cfg.model.init_from:  # the checkpoints' disk budget from the config, before the model is made
            self._check_disks({"arch": cfg.model.architecture(), **resolve(cfg.model, shards.n_vocab)})
        with self.startup.part("model"):
            self._build_model()
        if cfg.model.init_from:  # its sizes are the Hugging Face folder's
            self._check_disks(model_spec(self.raw_model))
        with self.startup.part("data"):
            self.accum, self.data, self.val = build.data(cfg, shards, self.gcfg.block_size, d.rank, d.world, self.cache)
        self.state = build.first_state(
            cfg, shards, lineage, d.world, self.data.stream.total, model_spec(self.raw_model)
        )
        self.started = Started(start_step=0, world_size=d.world)
        self.logger = MetricsLogger(cfg, d.device, d.world, flops_per_token(self.state.model), sink, d.is_main)
        self.validator, self.checkpointing = Validator(cfg), Checkpointing(cfg)
        self.guard, self.faults = DivergenceGuard(cfg), FaultHook(d.rank, d.world)
        self.goodput = Goodput(sink, self.startup.launched, d.is_main)
        self.compile_cache = CompileCache.of(cfg, run, d.world, d.device, d.rank)
        self.checkpoints = CheckpointManager(
            cfg,
            run,
            self.raw_model,
            self.optimizer,
            rank=d.rank,
            world=d.world,
            sharded=self.parallel.sharded,
            hold_for_eval=spec.hold_for_eval,
            fence=fence.check if fence else None,
        )

    # ---- set up ---------------------------------------------------------------------
    def _build_model(self) -> None:
        # the config the model is built under: activation checkpointing settled (self.cfg keeps `auto`, as recorded)
        self.planned = plan_memory(self.cfg, self.shards.n_vocab, self.d)
        self.raw_model = build.model(self.cfg, self.shards, self.d.device, self.cache, self.d.is_main)
        self.gcfg = self.raw_model.config
        self.parallel.shard(self.raw_model, self.planned, self.d)  # before the optimizer is made
        self.optimizer = build.optimizer(self.raw_model, self.t, fused=self.d.device.type == "cuda")

    def _check_disks(self, fields: dict) -> None:
        d = self.d
        CheckpointManager.check_disks(
            self.cfg, self.run, fields, sharded=self.parallel.sharded, rank=d.rank, world=d.world
        )

    # ---- the run --------------------------------------------------------------------
    def train(self) -> TrainResult:
        self.resume()
        self.goodput.begin(self.state.step)
        with self.startup.part("model"):
            self.model, self.autocast = self.parallel.wrap(self.raw_model, self.planned, self.d)
        with self.startup.part("compile_cache"):
            self.compile_cache.load()  # before the first step compiles: what an earlier attempt compiled
        params: list[torch.Tensor] = list(self.raw_model.parameters())
        self.parts = StepParts(self.model, params, self.optimizer, self.autocast, self.d.world > 1, self.t.grad_clip)
        self._describe()
        with self.startup.part("data"):
            self.batches = Prefetcher(self.data, self.state.cursor, self.d.device)
        self.preemption, heartbeat = Preemption(self.d.world, self.d.device.type == "cuda"), Heartbeat(self.d.rank)
        self.steps_run = 0
        try:
            while self.state.step < self.t.max_steps:
                self.faults.before_step(self.state.step + 1)
                loss, grad_norm, lr = self.step()
                if self.steps_run == 0:  # the optimizer state exists now: make the checkpoint copy buffers
                    self.checkpoints.prepare()
                    self.compile_cache.save()  # the first compile is done: its code to the store, for restarts
                self.steps_run += 1
                heartbeat.beat(self.state.step)
                if self.fence and self.d.is_main:  # a lost lease: stop before this step logs or saves anything
                    self.fence.due_check()
                if self.guard_or_log(loss, grad_norm, lr):
                    continue  # rolled back
                self.maybe_validate()
                if self.checkpointing.due(self.state.step):
                    self.save()
                self.faults.after_step(self.state.step, self.checkpoints.flush)
                stop, failed = self.preemption.poll(self.checkpoints.failed)
                if failed:  # a background save failed: the run stops at it, not at the next checkpoint
                    self.checkpoints.stop_on_failure()
                if stop:
                    self.preempt()
            heartbeat.finish(self.state.step)
        except BaseException as e:
            self.checkpoints.abort(e)  # a full cache disk: its staging given back; else what is committed finishes
            raise
        finally:
            self.batches.close()
            self.preemption.close()
            self.startup.report(self.state.step, self.sink, self.d.is_main, final=True)  # if one step ran
            self.goodput.record(self.state.step, self.steps_run, self.startup)  # the lineage's goodput so far
            self.compile_cache.close()
        self.checkpoints.close()  # wait for the last upload, every rank alike
        return self.result(ExitCode.DONE)

    def step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step; advances step, cursor and tokens seen."""
        lr = lr_at(self.state.step, self.t)
        with self.startup.step(self.d.device, self.batches):
            loss, grad_norm = train_step(
                self.parts,
                self.batches.get,
                self.accum,
                lr,
                poison=self.faults.poison(self.state.step + 1),
                before_update=self.checkpoints.before_update,
            )
        s = self.state
        s.step, s.cursor, s.tokens_seen = s.step + 1, s.cursor + self.data.per_step, s.tokens_seen + self.t.batch_tokens
        self.logger.steps += 1
        self.startup.report(s.step, self.sink, self.d.is_main)  # after the second step
        return loss, grad_norm, lr

    def guard_or_log(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> bool:
        """Check the loss on log steps and before every checkpoint; roll back (True) or log it."""
        step = self.state.step
        if not (self.logger.due(step) or self.checkpointing.due(step)):
            return False
        self.state.train_loss = all_mean(loss, self.d.world)
        problem = self.guard.problem(self.state.train_loss)
        if problem:
            self.rollback(problem)
            return True
        self.logger.log(
            step,
            self.state.train_loss,
            lr,
            float(grad_norm),
            self.state.tokens_seen,
            self.batches.waited_s,
            epoch=self.data.epoch(self.state.cursor),
        )
        self.goodput.record(step, self.steps_run, self.startup)
        return False

    def maybe_validate(self) -> None:
        step = self.state.step
        if not self.validator.due(step):
            return
        t0 = time.perf_counter()
        loss = val_loss(
            self.model, self.val, self.t.micro_batch, self.d.device, self.autocast, self.d.rank, self.d.world
        )
        self.validator.last = (step, loss)
        if self.d.is_main:
            self.sink.log({"loss/val": loss}, step)
            print(f"step {step} | val loss {loss:.4f}", flush=True)
        self.goodput.blocked_by("evaluation", time.perf_counter() - t0)
        self.logger.restart(self.batches.waited_s)

    # ---- checkpoints ----------------------------------------------------------------
    def save(self) -> None:
        """Every rank hands in its RNG state; rank 0 snapshots the state and returns (upload in background)."""
        if self.d.is_main:
            self.sink.flush(timeout=CHECKPOINT_FLUSH_S)  # the metrics before the checkpoint (a hung MLflow: once)
        self.state.val_loss = self.validator.at(self.state.step)
        blocked = self.checkpoints.save(self.state.model_dump(mode="json"))
        self.goodput.blocked_by("checkpoint", blocked)
        if self.d.is_main:  # the commit's line says the checkpoint; the time the loop waited is a metric
            self.sink.log({"system/checkpoint/blocked_s": blocked}, self.state.step)
        self.logger.restart(self.batches.waited_s)

    def resume(self) -> None:
        """Load the newest complete checkpoint (lmyard.checkpoint.manager); report what was loaded."""
        with self.startup.part("resume"):
            resumed = self.checkpoints.load(self.state.model)
        ckpt = resumed.loaded
        if ckpt is not None:
            self.restore(ckpt)
            if self.d.is_main:
                print(
                    f"resuming from {ckpt.uri} at step {ckpt.step} ({self.state.tokens_seen:,} tokens seen)", flush=True
                )
            if self.d.is_main and (changed := build.schedule_change(ckpt.state.config, self.t, ckpt.step)):
                print(changed, flush=True)
            if ckpt.state.shard_address != self.shards.address:
                self.state.cursor = build.new_data_cursor(ckpt.state, self.data, self.d.is_main)
            self.state.shard_address = self.shards.address
        self.started = Started(
            start_step=self.state.step,
            resumed_from=ckpt.uri if ckpt else None,
            skipped_damaged=resumed.damaged,
            world_size=self.d.world,
            device=self.d.device.type,
        )
        if self.exchange:
            self.exchange.write("started.json", self.started)

    def restore(self, ckpt: Loaded) -> None:
        """The trainer's state of a checkpoint the manager loaded (weights, optimizer state and RNG)."""
        old = ckpt.state
        self.state = self.state.model_copy(
            update={"step": old.step, "cursor": old.cursor, "tokens_seen": old.tokens_seen, "rollbacks": old.rollbacks}
        )

    def rollback(self, problem: str) -> None:
        """Back to the last checkpoint, skipping the batches since (the data cursor stays), or Diverged."""
        bad_step, rollbacks = self.state.step, self.state.rollbacks
        self.guard.check_rollback_allowed(bad_step, problem, rollbacks)
        ckpt = self.checkpoints.rollback_target(self.state.model)
        if ckpt is None:
            raise Diverged(
                f"training diverged at step {bad_step}: {problem}, and there is no checkpoint to roll "
                "back to; lower train.lr or checkpoint.interval"
            )
        cursor, skipped = self.state.cursor, self.state.cursor - ckpt.state.cursor
        self.restore(ckpt)
        self.state.cursor, self.state.rollbacks = cursor, rollbacks + 1
        self.batches.reset(cursor)
        if self.d.is_main:
            self.sink.log(
                {"system/guard/rollbacks": rollbacks + 1, "system/guard/skipped_sequences": skipped}, bad_step
            )
            print(
                f"divergence at step {bad_step}: {problem}; rolled back to {ckpt.uri} (step {ckpt.step}), "
                f"skipping {skipped} sequences; rollback {rollbacks + 1} of {self.t.guard.max_rollbacks}",
                flush=True,
            )
        self.logger.restart(self.batches.waited_s)

    def preempt(self) -> None:
        """Asked to stop: checkpoint this step (unless just saved); every rank waits until it is committed or
        `launch.grace_s` is spent, then ends as preempted saying what the store holds (read back, not assumed)."""
        step, grace = self.state.step, self.cfg.launch.grace_s
        if not self.checkpointing.due(step):
            self.save()
        waited = time.monotonic() - (self.preemption.requested_at or time.monotonic())
        try:
            self.checkpoints.flush(max(1.0, grace - waited))
        except StoreOutage:
            pass  # not committed within the grace: the message below says so, from what the store holds
        finally:
            self.preemption.barrier()  # no rank exits before the writers are done (torchrun stops the rest)
        committed = self.checkpoints.committed_steps()
        if step in committed:
            raise Preempted(
                f"stopped by SIGTERM after step {step}; checkpoint step {step} is in the store, "
                "and a rerun resumes from it"
            )
        last = (
            f"the last committed checkpoint is step {committed[-1]}, where a rerun resumes"
            if committed
            else "no checkpoint is committed, and a rerun starts from step 0"
        )
        raise Preempted(
            f"stopped by SIGTERM after step {step}; checkpoint step {step} was not committed within "
            f"launch.grace_s={grace:g} s; {last}"
        )

    # ---- reporting ------------------------------------------------------------------
    def _describe(self) -> None:
        if self.d.is_main:
            g, d, t = self.gcfg, self.d, self.t
            print(
                f"model: {self.raw_model.num_params():,} params, {g.n_layer} layers, d={g.n_embd}, "
                f"T={g.block_size}, vocab {g.vocab_size} | {d.world} ranks on {d.device.type} | "
                f"{t.batch_tokens:,} tokens/step = {t.micro_batch} seq * {g.block_size} tokens * {d.world} "
                f"ranks * {self.accum} micro-steps" + (f" | {self.parallel.name}" if self.parallel.sharded else ""),
                flush=True,
            )
            if warning := self.data.repeat_warning(self.t.max_steps):
                print(warning, flush=True)  # it says "warning:" itself

    def result(self, code: ExitCode, message: str | None = None) -> TrainResult:
        s = self.state
        return TrainResult.ended(
            code,
            message,
            step=s.step,
            tokens_seen=s.tokens_seen,
            val_loss=self.validator.last[1] if self.validator.last else None,
            train_loss=s.train_loss,
            rollbacks=s.rollbacks,
            start_step=self.started.start_step,
            resumed_from=self.started.resumed_from,
            last_checkpoint=self.checkpoints.last_checkpoint,
            compile_cache=self.compile_cache.report(),
        )


@dataclass(frozen=True)
class StepParts:
    """What every step uses: the model as it runs (wrapped), the clip's parameters, the optimizer, the forward's
    autocast, whether DDP syncs gradients, the clip's norm (0: none)."""

    model: torch.nn.Module
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    autocast: contextlib.AbstractContextManager
    distributed: bool
    grad_clip: float


def train_step(
    parts: StepParts, next_batch, accum: int, lr: float, poison: bool = False, before_update=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `accum` micro-batches; returns (mean loss, grad norm) as device tensors."""
    model, optimizer, grad_clip = parts.model, parts.optimizer, parts.grad_clip
    for group in optimizer.param_groups:  # Muon's groups at their multiple of the schedule's lr (lmyard.train.muon)
        group["lr"] = lr * group.get("lr_ratio", 1.0)
    loss_sum: torch.Tensor | None = None
    for micro in range(accum):
        x, y = next_batch()
        sync = micro == accum - 1 or not parts.distributed  # DDP all-reduces gradients on the last micro-step only
        with contextlib.nullcontext() if sync else no_sync(model), parts.autocast:
            loss = model(x, y)
        if poison:
            loss = loss * float("nan")
        (loss / accum).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    # the norm (over FSDP2's shards), the update (lmyard.train.optim); before_update: a checkpoint's copy ends first
    grad_norm = clipped_update(parts.params, optimizer, grad_clip if grad_clip > 0 else float("inf"), before_update)
    optimizer.zero_grad(set_to_none=True)
    assert loss_sum is not None, "accum >= 1 micro-step (grad_accum_steps)"
    return loss_sum / accum, grad_norm
