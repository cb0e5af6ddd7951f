"""What a checkpoint holds besides its manifest, as the loaders return it, for both formats.

`Checkpoint`: the whole state on one process (model by parameter name, optimizer
as `optimizer.state_dict()` gives it, every rank's RNG states, state.json), what
an evaluator, an export or a plain (DDP) model reads. `Loaded`: what a load
into a live model and optimizer came from. RNG states are tensors and plain
values, so `torch.load(weights_only=True)` reads them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from lmyard.checkpoint.schema import CheckpointState


@dataclass(frozen=True)
class Checkpoint:
    step: int
    uri: str
    model: dict
    optim: dict
    rng: list
    state: CheckpointState


@dataclass(frozen=True)
class Loaded:
    """What a load put into the model and optimizer came from: the step, its URI, RNG states and state.json."""

    step: int
    uri: str
    rng: list
    state: CheckpointState


def rng_state() -> dict:
    """This process's RNG states, as tensors and plain values (weights_only-loadable)."""
    np_state = np.random.get_state()  # legacy=True (the default): a tuple for the legacy MT19937 generator
    assert isinstance(np_state, tuple), "np.random.get_state() is a tuple unless legacy=False"
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
