"""`train.parallel`, chosen once: how the model's parameters are spread over the ranks.

    ddp   every rank holds the whole model; DDP all-reduces gradients; bf16 autocast on CUDA, the
          residual stream float32 or bfloat16 (train.residual_dtype)
    fsdp  every rank holds its shards (FSDP2 units, made before the optimizer so it holds
          DTensors); FSDP2 keeps bf16 weights itself (its mixed-precision policy): no autocast

The trainer asks a `Parallelism` (shard, wrap) and its CheckpointManager
(lmyard.checkpoint.manager, given `sharded`), never `train.parallel` itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lmyard.config import RunConfig
from lmyard.models import attention
from lmyard.models.base import LanguageModel, autocast
from lmyard.train.distributed.parallel import (
    apply_activation_checkpointing,
    apply_float8,
    block_params,
    compile_blocks,
    copies_mode,
    parallelize,
)
from lmyard.train.distributed.sharded_embedding import in_row_shards


class ComputeContext:
    """bf16 autocast on CUDA, and the causal attention kernel of model.attention (lmyard.models.attention.use_kernel:
    inside the model's graph; `fa4`: SDPA's flash backend through FlashAttention-4); reusable across steps."""

    def __init__(self, cuda: bool, attention: str):
        self.cuda, self.attention = cuda, attention

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        if self.cuda:
            self.stack.enter_context(autocast("cuda"))
        before = attention.use_kernel(self.attention)
        self.stack.callback(attention.use_kernel, before)
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def prepare_model(raw_model: torch.nn.Module, cfg: RunConfig, d) -> tuple[torch.nn.Module, ComputeContext]:
    """The model as the training step runs it: float8 linears (train.float8), activation checkpointing
    (train.activation_checkpointing, resolved), DDP (more than one rank), then torch.compile (default on CUDA: the
    whole model, or each block before DDP with train.compile_scope=blocks);
    and the autocast context for its forward, with TF32 matmuls on CUDA. `d`: the trainer's Dist (world,
    local_rank, device). On one GPU this is torchtitan's single-device path: no FSDP, bf16 autocast.

    DDP first, then compile: dynamo splits the compiled graph at DDP's bucket boundaries, so each bucket's
    all-reduce overlaps the rest of backward (compiling the bare model makes backward one opaque graph whose
    gradients all arrive at its end).
    """
    t, cuda = cfg.train, d.device.type == "cuda"
    if t.float8:
        apply_float8(raw_model, d.device, t.float8_recipe)
    apply_activation_checkpointing(raw_model, t.activation_checkpointing, t.activation_checkpointing_blocks)
    model = raw_model
    compiled = t.compile if t.compile is not None else cuda
    if compiled and t.compile_scope == "blocks":
        compile_blocks(raw_model)  # in place, before DDP: each block's backward its own graph, its buckets' hooks
    if d.world > 1:
        model = DDP(
            model,
            device_ids=[d.local_rank] if cuda else None,
            gradient_as_bucket_view=True,
            bucket_cap_mb=t.ddp_bucket_mb,
        )
    if compiled and t.compile_scope == "model":
        # torch types compile() as returning a callable; given a module it returns one (OptimizedModule)
        model = torch.compile(model)  # type: ignore[assignment]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if t.residual_dtype == "bfloat16" and isinstance(raw_model, LanguageModel):
            raw_model.residual_dtype = torch.bfloat16  # compiled lazily: the first forward sees it
    return model, ComputeContext(cuda, cfg.model.attention)


@dataclass(frozen=True)
class Parallelism:
    """How this run spreads its model (see the module doc)."""

    name: str

    @classmethod
    def of(cls, cfg: RunConfig) -> Parallelism:
        return cls(cfg.train.parallel)

    @property
    def sharded(self) -> bool:
        return self.name == "fsdp"

    def shard(self, model: torch.nn.Module, cfg: RunConfig, d) -> None:
        """Sharded: FSDP2 units, before the optimizer is made (it holds the shards of this rank); on a GPU, rank 0
        says how the token table and the layout copies run. `d`: this rank (lmyard.train.distributed.group.Dist)."""
        if not self.sharded:
            return
        parallelize(model, cfg, d.world, d.device)
        if d.is_main and d.device.type == "cuda":
            t = cfg.train
            table = "row shards" if in_row_shards(model) else "gathered"
            print(f"fsdp token table: {table} (train.fsdp_embedding={t.fsdp_embedding})", flush=True)
            copies = copies_mode(t, d.device, d.world, block_params(model))
            print(f"fsdp layout copies: {copies} streams (train.fsdp_copies={t.fsdp_copies})", flush=True)

    def wrap(self, raw_model: torch.nn.Module, cfg: RunConfig, d) -> tuple[torch.nn.Module, ComputeContext]:
        """The model the step runs and its compute context (FSDP2: the sharded model as it is, no autocast)."""
        if self.sharded:
            return raw_model, ComputeContext(False, cfg.model.attention)
        return prepare_model(raw_model, cfg, d)
