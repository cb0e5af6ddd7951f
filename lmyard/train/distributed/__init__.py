"""How training spreads over ranks and GPUs: this rank (`Dist`, `setup_distributed`: group.py), the memory plan
before the first step (memory.py), the strategy chosen once from train.parallel (`Parallelism`: parallelism.py),
FSDP2 and its helpers (parallel.py, fsdp_copies.py, sharded_embedding.py). The trainer imports this package's
names, never a decision on train.parallel."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmyard.train.distributed.group import Dist, setup_distributed
    from lmyard.train.distributed.memory import plan_memory
    from lmyard.train.distributed.parallel import no_sync
    from lmyard.train.distributed.parallelism import Parallelism

# each name from its module on first use (PEP 562): the memory plan stays importable without torch (a sweep's
# driver checks its trials with it)
_MODULE = {"Dist": "group", "setup_distributed": "group", "plan_memory": "memory", "no_sync": "parallel",
           "Parallelism": "parallelism"}  # fmt: skip
__all__ = ["Dist", "Parallelism", "no_sync", "plan_memory", "setup_distributed"]


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE[name]}"), name)
