"""How training spreads over ranks and GPUs: this rank (`Dist`, `setup_distributed`: group.py), the memory plan
before the first step (memory.py), the strategy chosen once from train.parallel (`Parallelism`: parallelism.py),
FSDP2 and its helpers (parallel.py, fsdp_copies.py, sharded_embedding.py). The trainer imports this package's
names, never a decision on train.parallel."""

from lmyard.train.distributed.group import Dist, setup_distributed
from lmyard.train.distributed.memory import plan_memory
from lmyard.train.distributed.parallel import no_sync
from lmyard.train.distributed.parallelism import Parallelism

__all__ = ["Dist", "Parallelism", "no_sync", "plan_memory", "setup_distributed"]
