"""The val loss, one routine for the trainer and the evaluator.

The trainer's `loss/val` (every rank, during training) and the evaluator's `loss/eval` (its own
process, from the checkpoint) come from `val_loss` here: the same sequences, the same float64 sums per
sequence, the same bf16 autocast on CUDA (lmyard.models.base.autocast), so the two agree at a step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lmyard.models.base import autocast


@torch.no_grad()
def val_loss(
    model: torch.nn.Module,
    val: torch.Tensor,
    micro_batch: int,
    device: torch.device | str,
    compute=None,
    rank: int = 0,
    world: int = 1,
) -> float:
    """Mean token loss over the fixed val sequences (n, T+1), summed per sequence in float64.

    `compute`: the context of each forward (default `autocast(device)`; the trainer passes its own, with its
    attention kernel). On `world` ranks each scores every world-th sequence and the sums are all-reduced;
    every rank makes the same number of forward calls (a rank out of rows scores a throwaway one): FSDP
    gathers in each, and every FSDP unit is sharded again at the end. The model is left in the mode it was in."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, sequences)
    mine = val[rank::world]
    calls = math.ceil(val[0::world].size(0) / micro_batch)  # rank 0 has the most rows
    for i in range(0, calls * micro_batch, micro_batch):
        rows = mine[i : i + micro_batch]
        scored = rows.size(0)
        rows = (rows if scored else val[:1]).to(device)
        with compute if compute is not None else autocast(device):
            loss = model(rows[:, :-1], rows[:, 1:])
        if scored:
            total[0] += loss.double() * scored
            total[1] += scored
    if world > 1:
        dist.all_reduce(total)
    _reshard(model)
    model.train(was_training)
    return float(total[0] / total[1])


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2 units that keep their gathered parameters from forward to backward
    (train.fsdp_reshard_after_forward=false) stay gathered after a forward with no backward: reshard them, so
    the memory is free again and a checkpoint saved next holds the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
