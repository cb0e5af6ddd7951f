"""The few collectives checkpointing needs (object broadcasts on a process group), and their one-process case."""

from __future__ import annotations

import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world(group=None) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if distributed() else (0, 1)


def agree(value, group=None):
    """Rank 0's value (rank 0 of `group`; default: of the world), on every rank."""
    if not distributed() or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]


def gather(value, group=None) -> list:
    """Every rank's value, on every rank."""
    if not distributed():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
