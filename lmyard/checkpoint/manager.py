"""The trainer's one door to checkpoints: a `CheckpointManager` on every rank, called alike on each.

    manager = CheckpointManager(cfg, ...)      (CheckpointManager.check_disks(cfg, ...) before the model is made)
    manager.load(model_spec)                   resume: the newest good checkpoint, agreed by every rank
    manager.prepare() / manager.save(state)    copy buffers after the first step / a snapshot, committed behind
    manager.rollback_target(model_spec)        the last checkpoint, loaded, for the divergence guard
    manager.flush(timeout_s)                   every checkpoint so far committed
    manager.close() / manager.abort(error)     the end of a run

Design notes: docs/checkpoints.md, `lmyard/checkpoint/manager.py`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmyard.checkpoint import budget, resume, retention
from lmyard.checkpoint.catalog import complete_steps, quarantine
from lmyard.checkpoint.checkpointer import make_checkpointer
from lmyard.checkpoint.state import Loaded, rng_state, set_rng_state
from lmyard.config import RunConfig
from lmyard.errors import ExitCode, NoSpace, Preempted, StoreFull, error_for, exit_code_of, one_line, status_of
from lmyard.paths import no_space
from lmyard.run import Run

# How long a rollback waits for the last good checkpoint to reach the store before it gives up with
# StoreOutage (the other ranks wait at a barrier meanwhile; NCCL's default collective timeout is 10 min).
FLUSH_TIMEOUT_S = 300.0

__all__ = ["FLUSH_TIMEOUT_S", "CheckpointManager", "Loaded", "Resumed"]


@dataclass(frozen=True)
class Resumed:
    """What `load` found: the checkpoint loaded (None: none, the run starts at step 0) and the damaged ones
    moved aside (their URIs)."""

    loaded: Loaded | None
    damaged: list[str]


class CheckpointManager:
    """This rank's checkpoints of one run (see the module doc). `model` and `optimizer` are the live ones the
    step updates; `sharded`: the model holds this rank's shards (lmyard.train.distributed.Parallelism)."""

    def __init__(
        self,
        cfg: RunConfig,
        run: Run,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: int,
        world: int,
        sharded: bool,
        hold_for_eval: bool = False,
        fence: Callable[[], None] | None = None,
    ):
        self.cfg, self.cache, self.model, self.optimizer = cfg, run.cache, model, optimizer
        self.rank, self.world, self.hold_for_eval = rank, world, hold_for_eval
        self.run = run
        self.checkpointer = make_checkpointer(cfg, run, rank, sharded=sharded, on_commit=self._committed, fence=fence)
        self.before_update = self.checkpointer.before_update  # the step calls it as it is: nothing in between
        self.last_checkpoint: str | None = None

    @staticmethod
    def check_disks(cfg: RunConfig, run: Run, fields: dict, *, sharded: bool, rank: int, world: int) -> None:
        """Before the first step: the checkpoints fit this node's disks (lmyard.checkpoint.budget). The full format
        stages on rank 0's node (ranks 0 .. LOCAL_WORLD_SIZE - 1), a sharded one each node its ranks' shards."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        share = local / world if sharded else float(rank < local)
        budget.check(cfg, run, fields, node_share=share)

    # ---- loading --------------------------------------------------------------------
    def load(self, model_spec: dict) -> Resumed:
        """Load the newest complete checkpoint (damaged ones are moved aside), exactly, with this rank's RNG
        state. Checkpoints an earlier attempt left staged (a full store) are committed first, so it resumes
        from them."""
        ckpt, damaged = self._latest(model_spec)
        if self.world > 1:
            found = [None] * self.world
            dist.all_gather_object(found, ckpt.step if ckpt else None)
            assert len(set(found)) == 1, f"ranks found different checkpoints: {found}"
            dist.barrier()  # every rank has read before a damaged one is moved
        if self.rank == 0:
            for step in damaged:
                quarantine(self.run, step)
        if ckpt is not None:
            self._restore_rng(ckpt)
        return Resumed(ckpt, [self.run.uri(self.run.layout.step(s)) for s in damaged])

    def rollback_target(self, model_spec: dict) -> Loaded | None:
        """The last checkpoint, once committed, loaded into the model and optimizer with this rank's RNG state
        (None: there is none)."""
        ckpt, _ = self._latest(model_spec)
        if ckpt is not None:
            self._restore_rng(ckpt)
        return ckpt

    def _latest(self, model_spec: dict) -> tuple[Loaded | None, list[int]]:
        """Everything saved so far committed, then (the newest good checkpoint, loaded; the damaged steps
        skipped). One of another model shape is a UserError (a lineage rerun with another preset), not damage."""
        self.flush()  # the last good checkpoint may still be uploading
        if self.world > 1:
            dist.barrier()
        return resume.load_latest(
            self.run,
            self.model,
            self.optimizer,
            self.cache,
            sharded=self.checkpointer.sharded,
            group=self.checkpointer.group,
            model_spec=model_spec,
        )

    def _restore_rng(self, ckpt: Loaded) -> None:
        if ckpt.state.world_size == self.world:
            set_rng_state(ckpt.rng[self.rank])
        elif self.rank == 0:
            print(
                f"resuming on {self.world} ranks from a checkpoint of {ckpt.state.world_size}: "
                "the token stream continues, per-rank RNG states restart",
                flush=True,
            )

    # ---- saving ---------------------------------------------------------------------
    def prepare(self) -> None:
        """After the first step (the optimizer state exists now): make the checkpoint copy buffers."""
        self.checkpointer.prepare(self.model, self.optimizer)

    def save(self, state: dict) -> float:
        """Every rank hands in its RNG state; rank 0 (every rank, sharded) snapshots the model, the optimizer and
        `state` (state.json) and returns, seconds blocked; serialized and committed in the background."""
        rng = self._gather_rng_or_stop()
        return self.checkpointer.save(self.model, self.optimizer, state, rng)

    def _gather_rng_or_stop(self) -> list:
        """Every rank's RNG state, gathered; with it, whether a checkpointer found the cache disk full: then every
        rank stops with that NoSpace together (rank 0 alone would leave the others to crash in a collective)."""
        error = self.checkpointer.error
        full = no_space(error) if error is not None else None
        mine = (rng_state(), str(full) if full else None)
        gathered: list = [mine]
        if self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, mine)
        message = next((m for _, m in gathered if m), None)
        if message:
            raise NoSpace(message)
        return [r for r, _ in gathered]

    def _committed(self, step: int, uri: str) -> None:
        self.last_checkpoint = uri
        print(f"checkpoint step {step} committed -> {uri}", flush=True)
        if not self.hold_for_eval:  # else the flow applies retention as it finishes evaluating each checkpoint
            retention.apply(self.run, self.cfg.checkpoint)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Block until every checkpoint so far is committed; StoreOutage after `timeout_s`."""
        self.checkpointer.flush(timeout_s)

    def committed_steps(self) -> list[int]:
        """The steps the store holds complete checkpoints of (read back, not assumed)."""
        return complete_steps(self.run)

    # ---- failing and ending ---------------------------------------------------------
    @property
    def failed(self) -> bool:
        """A background save failed on this rank (the run stops at it: `stop_on_failure`)."""
        return self.checkpointer.error is not None

    def stop_on_failure(self) -> None:
        """Every rank raises the first failing rank's background-save error (a collective when world > 1)."""
        self._raise_together(self.checkpointer.error)

    def close(self) -> None:
        """Wait for the last upload (a failing one gets checkpoint.upload_retries, then its error), and end every
        rank alike."""
        error = None
        try:
            self.checkpointer.close()
        except Exception as e:
            error = e
        self._raise_together(error)

    def abort(self, error: BaseException) -> None:
        """The run is failing with `error`. A full cache disk gives the staging space back and waits for nothing
        (a full store keeps it: a rerun uploads it); otherwise the uploads committed so far finish, without
        hanging on a dead store (preempted: the grace is spent, and the message said what is committed)."""
        full = no_space(error)
        if full is not None and not isinstance(full, StoreFull):
            self.checkpointer.discard()
            return
        with contextlib.suppress(Exception):
            self.checkpointer.close(timeout_s=0 if isinstance(error, Preempted) else 60)

    def _raise_together(self, error: BaseException | None) -> None:
        """Every rank raises the first failing rank's checkpoint error (a full cache disk or store, a store outage,
        a lost lease), so no other rank crashes in a collective; a full cache disk gives the staging space back.
        A collective when world > 1: call on every rank alike; returns when no rank has an error."""
        failure = None
        if error is not None:
            known = no_space(error) or error
            failure = (int(exit_code_of(known)), one_line(known), status_of(known), isinstance(known, StoreFull))
        if self.world > 1:  # every rank's outcome (a barrier too)
            outcomes: list = [None] * self.world
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
