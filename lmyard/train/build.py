"""What the trainer is made of before its first step: the seeded generators, the model (from `model.*` or a
Hugging Face folder, model.init_from) and the data (the train stream in this rank's batches, the val
sequences), with gradient accumulation settled from train.batch_tokens, the optimizer (train.optimizer), and where a resumed lineage's data
continues when its shard set changed."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from lmyard.checkpoint.schema import CheckpointState
from lmyard.config import RunConfig, TrainConfig
from lmyard.data.loader import TrainBatches, split_stream, val_sequences
from lmyard.data.shards import ShardSet
from lmyard.errors import UserError
from lmyard.models.base import LanguageModel
from lmyard.models.registry import build_model, doc_fields, model_from_spec
from lmyard.tracking.lineage import LineageRef
from lmyard.train.optim import AdamW


def seed_everything(seed: int, rank: int) -> None:
    """Seed every generator a run touches: the same init on every rank (torch), per-rank streams for Python's
    and numpy's global generators, so two runs of one config save identical RNG states."""
    torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def grad_accum_steps(cfg: RunConfig, world: int, seq_len: int) -> int:
    per_micro = cfg.train.micro_batch * seq_len * world
    if cfg.train.batch_tokens % per_micro:
        raise UserError(
            f"train.batch_tokens ({cfg.train.batch_tokens}) must be a multiple of micro_batch * block_size * "
            f"world size ({cfg.train.micro_batch} * {seq_len} * {world} = {per_micro}); "
            f"e.g. --set train.batch_tokens={per_micro * max(1, round(cfg.train.batch_tokens / per_micro))}"
        )
    return cfg.train.batch_tokens // per_micro


def model(cfg: RunConfig, shards: ShardSet, device: torch.device, cache_dir: str, is_main: bool) -> LanguageModel:
    """The model on `device`: a Hugging Face folder's sizes and weights (model.init_from; a checkpoint wins at
    resume), else freshly initialised; a UserError when its vocabulary is smaller than the shard set's."""
    with torch.device(device):
        if cfg.model.init_from:
            built = _from_hf(cfg, shards, cfg.model.init_from, cache_dir, is_main)
        else:
            built = build_model(cfg.model, shards.n_vocab, shards.separators)
    if built.config.vocab_size < shards.n_vocab:
        raise UserError(
            f"model.vocab_size ({built.config.vocab_size}) is smaller than the shard set's vocabulary "
            f"({shards.n_vocab}, {shards.manifest['tokenizer']['name']}); unset it or raise it"
        )
    return built


def _from_hf(cfg: RunConfig, shards: ShardSet, path: str, cache_dir: str, is_main: bool) -> LanguageModel:
    from lmyard.export.hf import init_from_hf

    state, spec = init_from_hf(path, os.path.join(cache_dir, "init-from"), cfg.tracking.uri)
    built = model_from_spec({**spec, **doc_fields(cfg.model, shards.separators)})
    built.load_state_dict(state)
    if is_main:
        print(f"initialised from {path}: {spec}", flush=True)
    return built


def data(
    cfg: RunConfig, shards: ShardSet, block_size: int, rank: int, world: int, cache_dir: str
) -> tuple[int, TrainBatches, torch.Tensor]:
    """(micro-steps per step, this rank's train batches, the val sequences)."""
    accum = grad_accum_steps(cfg, world, block_size)
    batches = TrainBatches(
        split_stream(shards, cfg.store, "train", cache_dir),
        block_size,
        cfg.train.micro_batch,
        accum,
        rank,
        world,
        shuffle_seed=cfg.train.seed if cfg.data.shuffle_sequences else None,
    )
    val = val_sequences(split_stream(shards, cfg.store, "val", cache_dir), block_size, cfg.eval.val_tokens)
    return accum, batches, val


def first_state(
    cfg: RunConfig, shards: ShardSet, lineage: LineageRef | None, world: int, train_tokens: int, model: dict
) -> CheckpointState:
    """The state of a run before its first step (a resume replaces it with its checkpoint's)."""
    return CheckpointState(
        step=0,
        cursor=0,
        tokens_seen=0,
        world_size=world,
        shard_address=shards.address,
        train_tokens=train_tokens,
        config=cfg.redacted_dump(),  # no password in a checkpoint
        lineage=lineage.to_dict() if lineage else None,
        model=model,
    )


def new_data_cursor(state: CheckpointState, data: TrainBatches, is_main: bool) -> int:
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
    if is_main:
        print(f"the shard set changed from {state.shard_address} to this run's: continuing {where}", flush=True)
    return cursor


def optimizer(model: LanguageModel, t: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    """train.optimizer's: AdamW over every parameter (decay on matrices), or Muon for the blocks' matrices beside
    AdamW for the rest (lmyard.train.muon)."""
    if t.optimizer == "muon":
        from lmyard.train import muon

        return muon.build(model, t, fused)
    return AdamW(model.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)


SCHEDULE_KEYS = ("schedule", "max_steps", "decay_fraction", "warmup_steps", "lr", "min_lr_ratio")


def schedule_change(saved: dict, t: TrainConfig, step: int) -> str | None:
    """The line a resume prints when the lr schedule differs from the checkpoint's (its config, `saved`): the lr
    is a function of the step and this config (lmyard.train.trainer.lr_at), so the run follows the new schedule
    from `step` on; weights, optimizer state and data continue exactly. None when it is the same."""
    old = saved.get("train", {})
    diff = [f"{k} {old[k]} -> {getattr(t, k)}" for k in SCHEDULE_KEYS if k in old and old[k] != getattr(t, k)]
    if not diff:
        return None
    return (
        f"the lr schedule changed since the checkpoint ({', '.join(diff)}): from step {step} the lr follows "
        f"train.schedule={t.schedule} as configured now; weights, optimizer state and data continue exactly"
    )
