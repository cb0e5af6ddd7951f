"""This rank in the job: `Dist` (rank, local rank, world size, device) and `setup_distributed`, which makes it.

`setup_distributed(cfg)` reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE),
picks the device (train.device), checks what model.attention=fa4 needs, and makes the process group
(lmyard.train.distributed.parallel.init_process_group: NCCL on CUDA, gloo on CPU; a copy_engine all-gather
that cannot run stops here, before any model is made).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.models.ops import flash4
from lmyard.train.distributed.memory import use_expandable_segments
from lmyard.train.distributed.parallel import init_process_group
from lmyard.train.distributed.parallelism import Parallelism


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: RunConfig) -> Dist:
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world, local_world = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UserError("train.device is `cuda` but no GPU is visible; set train.device=cpu")
        use_expandable_segments()
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.train.threads_per_rank or max(1, (os.cpu_count() or 1) // local_world))
    if cfg.model.attention == "fa4" and (lacks := flash4.missing(device)):
        raise UserError(f"model.attention=fa4 needs {lacks}; otherwise set model.attention=auto")
    gather = init_process_group(cfg.train, device, world, local_world)  # a copy_engine that cannot run stops here
    if rank == 0 and use_cuda and Parallelism.of(cfg).sharded:
        print(f"fsdp all-gather: {gather} (train.fsdp_all_gather={cfg.train.fsdp_all_gather})", flush=True)
    return Dist(rank, local_rank, world, device)
