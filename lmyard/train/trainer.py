"""The training loop: the torchrun entrypoint run on every node.

    torchrun --nproc_per_node=8 -m lmyard.stages train --spec spec.json

The spec (lmyard.contracts.TrainSpec: a JSON file, or the LMYARD_SPEC
environment variable) holds the run config, the shard set, the lineage and
`hold_for_eval` (the flow evaluates every checkpoint and applies retention
itself). `Trainer.train()` reads top to bottom: resume -> loop { step ->
guard -> log -> validate -> checkpoint -> faults -> preemption }, each
component deciding when it is due (lmyard.components). It resumes from the
newest complete checkpoint of `runs/<run_name>` exactly: weights, AdamW state,
step, data cursor and every rank's RNG state (Python's, numpy's and torch's,
all seeded at the start). How the job ended goes to `<exchange>/result.json`
and the exit code (lmyard.errors.ExitCode), never only to the log. Imports
stay light (no mlflow or boto3 until used) so the entrypoint starts fast.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from lmyard.checkpoint import budget, resume, retention
from lmyard.checkpoint.catalog import complete_steps, quarantine
from lmyard.checkpoint.checkpointer import make_checkpointer
from lmyard.checkpoint.state import Loaded, rng_state, set_rng_state
from lmyard.config import RunConfig, TrainConfig
from lmyard.contracts import (
    CheckpointState,
    Exchange,
    LineageRef,
    Started,
    TrainResult,
    TrainSpec,
    one_line,
    read_spec,
    run_stage,
)
from lmyard.data.loader import Prefetcher, TrainBatches, default_cache_dir, split_stream, val_sequences
from lmyard.data.shards import ShardSet
from lmyard.errors import (
    Diverged,
    ExitCode,
    NoSpace,
    Preempted,
    StoreFull,
    StoreOutage,
    UserError,
    error_for,
    exit_code_of,
    status_of,
)
from lmyard.evaluate.validation import val_loss
from lmyard.layout import RunLayout
from lmyard.models.base import LanguageModel
from lmyard.models.registry import build_model, doc_fields, flops_per_token, model_from_spec, model_spec, resolve
from lmyard.paths import no_space
from lmyard.store import open_store
from lmyard.tracking.lease import Fence
from lmyard.tracking.sink import MetricsSink, NullSink, metrics_sink, system_metrics
from lmyard.train.components import (
    Checkpointing,
    DivergenceGuard,
    FaultHook,
    MetricsLogger,
    Preemption,
    Validator,
    all_mean,
)
from lmyard.train.distributed import Dist, Parallelism, no_sync, plan_memory, setup_distributed
from lmyard.train.optim import AdamW, clipped_update
from lmyard.train.watchdog import Heartbeat

# How long a rollback waits for the last good checkpoint to reach the store before it gives up with
# StoreOutage (the other ranks wait at a barrier meanwhile; NCCL's default collective timeout is 10 min).
FLUSH_TIMEOUT_S = 300.0
# How long a checkpoint waits for the metrics logged so far to reach MLflow (lmyard.tracking.sink.MLflowSink.flush).
CHECKPOINT_FLUSH_S = 5.0


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to t.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at max_steps."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * coeff)


def grad_accum_steps(cfg: RunConfig, world: int, seq_len: int) -> int:
    per_micro = cfg.train.micro_batch * seq_len * world
    if cfg.train.batch_tokens % per_micro:
        raise UserError(
            f"train.batch_tokens ({cfg.train.batch_tokens}) must be a multiple of micro_batch * block_size * "
            f"world size ({cfg.train.micro_batch} * {seq_len} * {world} = {per_micro}); "
            f"e.g. --set train.batch_tokens={per_micro * max(1, round(cfg.train.batch_tokens / per_micro))}"
        )
    return cfg.train.batch_tokens // per_micro


def seed_everything(seed: int, rank: int) -> None:
    """Seed every generator a run touches: the same init on every rank (torch), per-rank streams for Python's
    and numpy's global generators, so two runs of one config save identical RNG states."""
    torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def out_of_memory(e: BaseException, cfg: RunConfig, step: int) -> UserError | None:
    """A UserError naming the settings to change when `e` is an allocation failure, else None."""
    text = str(e)
    if not (
        isinstance(e, (torch.OutOfMemoryError, MemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    ):
        return None
    t = cfg.train
    return UserError(
        f"out of memory at step {step} with train.micro_batch={t.micro_batch} x model.block_size: "
        f"lower train.micro_batch (train.batch_tokens={t.batch_tokens} stays; gradient accumulation "
        "grows), or choose a smaller model"
    )


class Trainer:
    """One run of the loop on this rank. `train()` only delegates; the components decide what is due."""

    def __init__(
        self,
        cfg: RunConfig,
        shards: ShardSet,
        lineage: LineageRef | None,
        d: Dist,
        sink: MetricsSink,
        hold_for_eval: bool = False,
        fence: Fence | None = None,
    ):
        self.cfg, self.t, self.shards, self.lineage, self.d, self.sink = cfg, cfg.train, shards, lineage, d, sink
        self.hold_for_eval, self.fence = hold_for_eval, fence  # the lineage's lease (lmyard.tracking.lease)
        self.store, self.cache = open_store(cfg.store), default_cache_dir()
        self.exchange = Exchange.from_env() if d.is_main else None
        seed_everything(self.t.seed, d.rank)
        if not cfg.model.init_from:  # the checkpoints' disk budget from the config, before the model is made
            self._check_disks({"arch": cfg.model.architecture(), **resolve(cfg.model, shards.n_vocab)})
        self._build_model()
        if cfg.model.init_from:  # its sizes are the Hugging Face folder's
            self._check_disks(model_spec(self.raw_model))
        self._build_data()
        self.state = CheckpointState(
            step=0,
            cursor=0,
            tokens_seen=0,
            world_size=d.world,
            shard_address=shards.address,
            train_tokens=self.data.stream.total,
            config=cfg.redacted_dump(),  # no password in a checkpoint
            lineage=lineage.to_dict() if lineage else None,
            model=model_spec(self.raw_model),
        )
        self.started = Started(start_step=0, world_size=d.world)
        self.logger = MetricsLogger(cfg, d.device, d.world, flops_per_token(self.state.model), sink, d.is_main)
        self.validator, self.checkpointing = Validator(cfg), Checkpointing(cfg)
        self.guard, self.faults = DivergenceGuard(cfg), FaultHook(d.rank, d.world)
        self.checkpointer = make_checkpointer(
            cfg,
            self.store,
            self.cache,
            d.rank,
            sharded=self.parallel.sharded,
            on_commit=self._committed,
            fence=fence.check if fence else None,
        )
        self.last_checkpoint: str | None = None

    # ---- set up ---------------------------------------------------------------------
    def _build_model(self) -> None:
        # the config the model is built under: activation checkpointing settled (self.cfg keeps `auto`, as recorded)
        self.planned = plan_memory(self.cfg, self.shards.n_vocab, self.d)
        with torch.device(self.d.device):
            if self.cfg.model.init_from:  # a Hugging Face folder: its sizes and weights (a checkpoint wins at resume)
                self.raw_model = self._from_hf(self.cfg.model.init_from)
            else:
                self.raw_model = build_model(self.cfg.model, self.shards.n_vocab, self.shards.separators)
        self.gcfg = self.raw_model.config
        if self.gcfg.vocab_size < self.shards.n_vocab:
            raise UserError(
                f"model.vocab_size ({self.gcfg.vocab_size}) is smaller than the shard set's vocabulary "
                f"({self.shards.n_vocab}, {self.shards.manifest['tokenizer']['name']}); unset it or raise it"
            )
        self.parallel = Parallelism.of(self.cfg)  # chosen once: the trainer never asks train.parallel again
        self.parallel.shard(self.raw_model, self.planned, self.d)  # before the optimizer is made
        self.optimizer = AdamW(
            self.raw_model.param_groups(self.t.weight_decay),
            lr=self.t.lr,
            betas=(self.t.beta1, self.t.beta2),
            fused=self.d.device.type == "cuda",
        )

    def _check_disks(self, fields: dict) -> None:
        """Before the first step: the checkpoints fit this node's disks (lmyard.checkpoint.budget). The full format
        stages on rank 0's node (ranks 0 .. LOCAL_WORLD_SIZE - 1), fsdp each node its ranks' shards."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        share = local / self.d.world if self.cfg.train.parallel == "fsdp" else float(self.d.rank < local)
        budget.check(self.cfg, self.store, self.cache, fields, node_share=share)

    def _from_hf(self, path: str) -> LanguageModel:
        from lmyard.export.hf import init_from_hf

        state, spec = init_from_hf(path, os.path.join(self.cache, "init-from"), self.cfg.tracking.uri)
        model = model_from_spec({**spec, **doc_fields(self.cfg.model, self.shards.separators)})
        model.load_state_dict(state)
        if self.d.is_main:
            print(f"initialised from {path}: {spec}", flush=True)
        return model

    def _build_data(self) -> None:
        T = self.gcfg.block_size
        self.accum = grad_accum_steps(self.cfg, self.d.world, T)
        self.data = TrainBatches(
            split_stream(self.shards, self.cfg.store, "train", self.cache),
            T,
            self.t.micro_batch,
            self.accum,
            self.d.rank,
            self.d.world,
            shuffle_seed=self.t.seed if self.cfg.data.shuffle_sequences else None,
        )
        self.val = val_sequences(
            split_stream(self.shards, self.cfg.store, "val", self.cache), T, self.cfg.eval.val_tokens
        )

    # ---- the run --------------------------------------------------------------------
    def train(self) -> TrainResult:
        self.resume()
        self.model, self.autocast = self.parallel.wrap(self.raw_model, self.planned, self.d)
        self.params: list[torch.Tensor] = list(self.raw_model.parameters())
        self._describe()
        self.batches = Prefetcher(self.data, self.state.cursor, self.d.device)
        self.preemption, heartbeat = Preemption(self.d.world, self.d.device.type == "cuda"), Heartbeat(self.d.rank)
        steps_run = 0
        try:
            while self.state.step < self.t.max_steps:
                self.faults.before_step(self.state.step + 1)
                loss, grad_norm, lr = self.step()
                if steps_run == 0:  # the optimizer state exists now: make the checkpoint copy buffers
                    self.checkpointer.prepare(self.raw_model, self.optimizer)
                steps_run += 1
                heartbeat.beat(self.state.step)
                if self.fence and self.d.is_main:  # a lost lease: stop before this step logs or saves anything
                    self.fence.due_check()
                if self.guard_or_log(loss, grad_norm, lr):
                    continue  # rolled back
                self.maybe_validate()
                if self.checkpointing.due(self.state.step):
                    self.save()
                self.faults.after_step(self.state.step, self.flush)
                stop, failed = self.preemption.poll(self.checkpointer.error is not None)
                if failed:  # a background save failed: the run stops at it, not at the next checkpoint
                    self._raise_together(self.checkpointer.error)
                if stop:
                    self.preempt()
        except BaseException as e:
            full = no_space(e)
            if full is not None and not isinstance(full, StoreFull):  # the cache disk is full: give the staging
                self.checkpointer.discard()  # space back, wait for nothing (a full store keeps it: a rerun uploads it)
                raise
            # let committed-so-far uploads finish, but not hang on a dead store; preempted, the grace is spent
            # and the message has said what is committed
            with contextlib.suppress(Exception):
                self.checkpointer.close(timeout_s=0 if isinstance(e, Preempted) else 60)
            raise
        finally:
            self.batches.close()
            self.preemption.close()
        self._close_together()  # wait for the last upload
        return self.result(ExitCode.DONE)

    def _close_together(self) -> None:
        """Wait for the last upload (a failing one gets checkpoint.upload_retries, then its error), and end every
        rank alike."""
        error = None
        try:
            self.checkpointer.close()
        except Exception as e:
            error = e
        self._raise_together(error)

    def _raise_together(self, error: BaseException | None) -> None:
        """Every rank raises the first failing rank's checkpoint error (a full cache disk or store, a store outage,
        a lost lease), so no other rank crashes in a collective; a full cache disk gives the staging space back.
        A collective when world > 1: call on every rank alike; returns when no rank has an error."""
        failure = None
        if error is not None:
            known = no_space(error) or error
            failure = (int(exit_code_of(known)), one_line(known), status_of(known), isinstance(known, StoreFull))
        if self.d.world > 1:  # every rank's outcome (a barrier too)
            outcomes: list = [None] * self.d.world
            dist.all_gather_object(outcomes, failure)
            failure = next((f for f in outcomes if f), None)
        if failure is None:
            return
        code, message, status, store_full = failure
        if error is not None and code == ExitCode.CRASHED:
            raise error  # unexpected: with its traceback
        agreed = StoreFull(message) if store_full else error_for(code, message, status)
        if isinstance(agreed, NoSpace) and not store_full:
            self.checkpointer.discard()
        raise agreed

    def step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step; advances step, cursor and tokens seen."""
        lr = lr_at(self.state.step, self.t)
        loss, grad_norm = train_step(
            self.model,
            self.params,
            self.optimizer,
            self.batches.get,
            self.accum,
            lr,
            self.t.grad_clip,
            self.autocast,
            self.d.world > 1,
            poison=self.faults.poison(self.state.step + 1),
            before_update=self.checkpointer.before_update,
        )
        s = self.state
        s.step, s.cursor, s.tokens_seen = s.step + 1, s.cursor + self.data.per_step, s.tokens_seen + self.t.batch_tokens
        self.logger.steps += 1
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
        return False

    def maybe_validate(self) -> None:
        step = self.state.step
        if not self.validator.due(step):
            return
        loss = val_loss(
            self.model, self.val, self.t.micro_batch, self.d.device, self.autocast, self.d.rank, self.d.world
        )
        self.validator.last = (step, loss)
        if self.d.is_main:
            self.sink.log({"val/loss": loss}, step)
            print(f"step {step} | val loss {loss:.4f}", flush=True)
        self.logger.restart(self.batches.waited_s)

    # ---- checkpoints ----------------------------------------------------------------
    def save(self) -> None:
        """Every rank hands in its RNG state; rank 0 snapshots the state and returns (upload in background)."""
        rng = self._gather_rng_or_stop()
        if self.d.is_main:
            # metrics up to this step reach MLflow before the checkpoint exists, unless MLflow hangs: then the loop
            # waits once (CHECKPOINT_FLUSH_S), not at every checkpoint, and the sink resends when it can
            self.sink.flush(timeout=CHECKPOINT_FLUSH_S)
        self.state.val_loss = self.validator.at(self.state.step)
        blocked = self.checkpointer.save(self.raw_model, self.optimizer, self.state.model_dump(mode="json"), rng)
        if self.d.is_main:
            print(
                f"checkpoint step {self.state.step} saving in the background (loop blocked {blocked * 1000:.1f} ms)",
                flush=True,
            )
            self.sink.log({"checkpoint/blocked_s": blocked}, self.state.step)
        self.logger.restart(self.batches.waited_s)

    def _gather_rng_or_stop(self) -> list:
        """Every rank's RNG state, gathered; with it, whether a checkpointer found the cache disk full: then every
        rank stops with that NoSpace together (rank 0 alone would leave the others to crash in a collective)."""
        error = self.checkpointer.error
        full = no_space(error) if error is not None else None
        mine = (rng_state(), str(full) if full else None)
        gathered: list = [mine]
        if self.d.world > 1:
            gathered = [None] * self.d.world
            dist.all_gather_object(gathered, mine)
        message = next((m for _, m in gathered if m), None)
        if message:
            raise NoSpace(message)
        return [r for r, _ in gathered]

    def _committed(self, step: int, uri: str) -> None:
        self.last_checkpoint = uri
        print(f"checkpoint step {step} committed -> {uri}", flush=True)
        if not self.hold_for_eval:  # else the flow applies retention as it finishes evaluating each checkpoint
            retention.apply(self.store, self.cfg.run_name, self.cfg.checkpoint)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        self.checkpointer.flush(timeout_s)

    def resume(self) -> None:
        """Load the newest complete checkpoint (damaged ones are moved aside), exactly; report what was loaded.
        Checkpoints an earlier attempt left staged (a full store) are committed first, so it resumes from them."""
        self.flush()
        if self.d.world > 1:
            dist.barrier()
        ckpt, damaged = self._find_latest()
        if self.d.world > 1:
            found = [None] * self.d.world
            dist.all_gather_object(found, ckpt.step if ckpt else None)
            assert len(set(found)) == 1, f"ranks found different checkpoints: {found}"
            dist.barrier()  # every rank has read before a damaged one is moved
        if self.d.is_main:
            for step in damaged:
                quarantine(self.store, self.cfg.run_name, step)
        if ckpt is not None:
            self.restore(ckpt)
            if self.d.is_main:
                print(
                    f"resuming from {ckpt.uri} at step {ckpt.step} ({self.state.tokens_seen:,} tokens seen)", flush=True
                )
            if ckpt.state.shard_address != self.shards.address:
                self.state.cursor = new_data_cursor(ckpt.state, self.data, self.d)
            self.state.shard_address = self.shards.address
        self.started = Started(
            start_step=self.state.step,
            resumed_from=ckpt.uri if ckpt else None,
            skipped_damaged=[self.store.uri(RunLayout(self.cfg.run_name).step(s)) for s in damaged],
            world_size=self.d.world,
        )
        if self.exchange:
            self.exchange.write("started.json", self.started)

    def _find_latest(self) -> tuple[Loaded | None, list[int]]:
        """(the newest good checkpoint, loaded into the model and optimizer; the damaged steps skipped). One of
        another model shape is a UserError (a lineage rerun with another preset), not damage."""
        return resume.load_latest(
            self.store,
            self.cfg.run_name,
            self.raw_model,
            self.optimizer,
            self.cache,
            sharded=self.checkpointer.sharded,
            group=self.checkpointer.group,
            model_spec=self.state.model,
        )

    def restore(self, ckpt: Loaded) -> None:
        """The trainer's state and RNG of a checkpoint whose weights and optimizer state are loaded already."""
        old = ckpt.state
        self.state = self.state.model_copy(
            update={"step": old.step, "cursor": old.cursor, "tokens_seen": old.tokens_seen, "rollbacks": old.rollbacks}
        )
        if old.world_size == self.d.world:
            set_rng_state(ckpt.rng[self.d.rank])
        elif self.d.is_main:
            print(
                f"resuming on {self.d.world} ranks from a checkpoint of {old.world_size}: "
                "the token stream continues, per-rank RNG states restart",
                flush=True,
            )

    def rollback(self, problem: str) -> None:
        """Back to the last checkpoint, skipping the batches since (the data cursor stays), or Diverged."""
        bad_step, rollbacks = self.state.step, self.state.rollbacks
        self.guard.check_rollback_allowed(bad_step, problem, rollbacks)
        self.flush()  # the last good checkpoint may still be uploading
        if self.d.world > 1:
            dist.barrier()
        ckpt, _ = self._find_latest()
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
            self.sink.log({"guard/rollbacks": rollbacks + 1, "guard/skipped_sequences": skipped}, bad_step)
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
            self.flush(max(1.0, grace - waited))
        except StoreOutage:
            pass  # not committed within the grace: the message below says so, from what the store holds
        finally:
            # no rank exits before the writers are done: torchrun stops every rank once one has exited
            self.preemption.barrier()
        committed = complete_steps(self.store, self.cfg.run_name)
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
            last_checkpoint=self.last_checkpoint,
        )


def new_data_cursor(state: CheckpointState, data: TrainBatches, d: Dist) -> int:
    """Where a lineage continues when its shard set changed (retraining on new data).

    An append-only source keeps the old train stream as a prefix of the new one:
    continue at the first sequence past the old tokens. Otherwise start the new stream.
    """
    old_tokens = state.train_tokens
    first_new = old_tokens // data.T
    if data.shuffle_seed is not None:  # a shuffled order has no "past the old tokens": the new stream, from its start
        where, cursor = "from the start of the new shard set (sequences are shuffled)", 0
    elif 0 < old_tokens < data.stream.total and first_new < data.n_seq:
        where, cursor = f"at the first sequence past its {old_tokens:,} tokens (the data that is new)", first_new
    else:
        where, cursor = "from the start of the new shard set", 0
    if d.is_main:
        print(f"the shard set changed from {state.shard_address} to this run's: continuing {where}", flush=True)
    return cursor


def train_step(
    model: torch.nn.Module,
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    next_batch,
    accum: int,
    lr: float,
    grad_clip: float,
    autocast,
    distributed: bool,
    poison: bool = False,
    before_update=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `accum` micro-batches; returns (mean loss, grad norm) as device tensors."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum: torch.Tensor | None = None
    for micro in range(accum):
        x, y = next_batch()
        sync = micro == accum - 1 or not distributed  # DDP all-reduces gradients on the last micro-step only
        with contextlib.nullcontext() if sync else no_sync(model), autocast:
            loss = model(x, y)
        if poison:
            loss = loss * float("nan")
        (loss / accum).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    # the norm (over the ranks' shards under FSDP2), then AdamW on the clipped gradients (lmyard.train.optim);
    # before_update: a checkpoint copy of the weights in flight must finish before they change
    grad_norm = clipped_update(params, optimizer, grad_clip if grad_clip > 0 else float("inf"), before_update)
    optimizer.zero_grad(set_to_none=True)
    assert loss_sum is not None, "accum >= 1 micro-step (grad_accum_steps)"
    return loss_sum / accum, grad_norm


def node_system_metrics(cfg: RunConfig, lineage: LineageRef | None, d: Dist):
    """On each node's local rank 0: CPU, memory, disk, network and GPU metrics of this node, as
    `system/node<N>/...` in the lineage's run (N: torchrun's node rank, stable across attempts)."""
    if lineage is None or d.local_rank != 0 or not cfg.tracking.system_metrics:
        return contextlib.nullcontext()
    return system_metrics(
        lineage, node_id=f"node{os.environ.get('GROUP_RANK', '0')}", interval_s=cfg.tracking.system_metrics_interval_s
    )


def _train(spec_path: str | None, run: dict) -> TrainResult:
    """The stage's body on one rank: setup, the Trainer, its result (`run` keeps what the failure path needs)."""
    spec = read_spec(TrainSpec, spec_path)
    cfg, lineage = spec.config, spec.lineage
    run["d"] = d = setup_distributed(cfg)
    if d.world > 1 and d.local_rank == 0:  # one line per node: which ranks run where
        import socket

        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        print(f"{socket.gethostname()}: ranks {d.rank}-{d.rank + local - 1} of {d.world} joined", flush=True)
    run["sink"] = metrics_sink(lineage, d.is_main)  # rank 0 logs to MLflow; the others to nothing
    with node_system_metrics(cfg, lineage, d):
        fence = Fence(open_store(cfg.store), cfg.run_name, spec.lease) if spec.lease else None
        run["trainer"] = trainer = Trainer(
            cfg, spec.shards, lineage, d, run["sink"], hold_for_eval=spec.hold_for_eval, fence=fence
        )
        try:
            result = trainer.train()
        except Exception as e:
            oom = out_of_memory(e, cfg, trainer.state.step)
            if oom is None:
                raise
            raise oom from None
    if d.is_main:  # one line, not one per rank
        print(f"training finished at step {result.step}", flush=True)
    return result


def train_stage(spec_path: str | None = None) -> int:
    """`python -m lmyard.stages train` on every rank: rank 0 writes result.json, any other rank that fails
    writes failures/rank-R.json (lmyard.contracts.run_stage, the one path from an exception to an exit code)."""
    run: dict = {"d": None, "trainer": None, "sink": NullSink()}
    exchange = Exchange.from_env()
    rank = int(os.environ.get("RANK", 0))  # torchrun's; the same as the process group's once it is set up

    def failed(code: ExitCode, message: str) -> TrainResult:
        trainer = run["trainer"]
        return trainer.result(code, message) if trainer else TrainResult.ended(code, message)

    try:
        return run_stage(
            lambda: _train(spec_path, run),
            exchange.path("result.json") if exchange and rank == 0 else None,
            failure_out=exchange.path("result.json" if rank == 0 else f"failures/rank-{rank}.json")
            if exchange
            else None,
            failed=failed,
            quiet=rank != 0,  # a bad config fails every rank alike: rank 0 says it once
        )
    finally:
        with contextlib.suppress(Exception):
            run["sink"].close()
        if dist.is_initialized():
            dist.destroy_process_group()
