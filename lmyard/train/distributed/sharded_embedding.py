"""The input token table under fsdp, kept sharded by rows: each rank looks up every rank's tokens in its own rows.

Design notes: docs/models.md, `lmyard/train/distributed/sharded_embedding.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:  # DTensor's import (sympy with it) costs every rank a second: only the sharded path needs it
    from torch.distributed.tensor import DTensor

# torch 2.13 names them *_single (and warns on the older names, which torch 2.11 has alone)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def sharded_pays(world: int, tokens_per_rank: int, rows: int) -> bool:
    """train.fsdp_embedding=auto: shard the table's lookup where it moves fewer values than gathering the
    table does: two ranks or more, and the ranks' tokens of one micro-step no more than the table's rows."""
    return world > 1 and world * tokens_per_rank <= rows


def in_row_shards(model: nn.Module) -> bool:
    """Whether a table of `model` is looked up in its row shards (a ShardedEmbedding)."""
    return any(isinstance(m, ShardedEmbedding) for m in model.modules())


class _Lookup(torch.autograd.Function):
    """ids (this rank's, any shape), table (this rank's rows, from row `first`) -> the rows of ids (module docstring)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, table: torch.Tensor, first: int, group) -> torch.Tensor:
        world = dist.get_world_size(group)
        every = ids.new_empty((world * ids.numel(),))
        _all_gather(every, ids.reshape(-1), group=group)
        local = every - first
        outside = (local < 0) | (local >= table.shape[0])
        local.masked_fill_(outside, 0)
        if table.shape[0]:
            rows = F.embedding(local, table).masked_fill_(outside.unsqueeze(-1), 0)
        else:  # a rank past the last row (more ranks than rows, in chunks): it holds none of them
            rows = table.new_zeros((every.numel(), table.shape[1]))
        out = rows.new_empty((ids.numel(), table.shape[1]))
        _reduce_scatter(out, rows, group=group)
        ctx.save_for_backward(local, outside)
        ctx.group, ctx.rows = group, table.shape[0]
        return out.view(*ids.shape, table.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local, outside = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1]).contiguous()
        every = grad.new_empty((local.numel(), grad.shape[1]))
        _all_gather(every, grad, group=ctx.group)
        every.masked_fill_(outside.unsqueeze(-1), 0)
        table_grad = torch.ops.aten.embedding_dense_backward(every, local, ctx.rows, -1, False)
        return None, table_grad.div_(dist.get_world_size(ctx.group)), None, None  # the ranks' mean, as FSDP2's


class ShardedEmbedding(nn.Embedding):
    """An nn.Embedding whose weight is a row-sharded DTensor, looked up as the module docstring says; made in
    place from a plain one by `shard_rows` (the module, its name and its state_dict keys stay)."""

    compute_dtype: torch.dtype
    first: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = cast("DTensor", self.weight)
        if not (self.training and torch.is_grad_enabled()):  # the ranks' token counts may differ (the val loss)
            return F.embedding(ids, cast("DTensor", weight.to(self.compute_dtype)).full_tensor())
        table = weight.to_local().to(self.compute_dtype)
        group = weight.device_mesh.get_group()
        return _Lookup.apply(ids, table, self.first, group)


def shard_rows(embedding: nn.Embedding, mesh, compute_dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Make `embedding` a ShardedEmbedding on the 1-D `mesh`: its weight this rank's dim-0 chunk (torch.chunk's,
    as FSDP2's Shard(0) cuts it) on `device` as a DTensor, looked up in `compute_dtype` (bf16 on CUDA, as FSDP2
    would gather it). Returns the new weight, for fully_shard's ignored_params."""
    from torch.distributed.tensor import DTensor, Shard

    weight = embedding.weight
    rank, world = mesh.get_local_rank(), mesh.size()
    chunks = torch.chunk(weight.detach(), world, dim=0)
    rows = chunks[0].shape[0]
    local = chunks[rank] if rank < len(chunks) else weight.new_empty((0, weight.shape[1]))
    local = local.to(device, copy=True)
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], shape=weight.shape, stride=weight.stride())
    param = nn.Parameter(dtensor, requires_grad=weight.requires_grad)
    embedding.weight = param
    embedding.__class__ = ShardedEmbedding
    sharded = cast(ShardedEmbedding, embedding)
    sharded.compute_dtype, sharded.first = compute_dtype, min(rank * rows, weight.shape[0])
    return param
