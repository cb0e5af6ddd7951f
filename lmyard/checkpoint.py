"""Checkpoints in the store: a directory per step, files first, manifest last.

    runs/<run>/checkpoints/step_NNNNNNNN/model.pt       model weights (state_dict)
                                         optim.pt       AdamW state
                                         rng.pt         RNG states of every rank
                                         state.json     step, tokens seen, data cursor, config, lineage
                                         manifest.json  sizes + sha256 of the files above; written last

A checkpoint without its manifest does not exist. Tensors are loaded with
torch.load(weights_only=True): a checkpoint from a shared bucket cannot run code.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from lmyard.shards import sha256_file
from lmyard.store import Store

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d{8})$")


def checkpoints_prefix(run_name: str) -> str:
    return f"runs/{run_name}/checkpoints"


def step_prefix(run_name: str, step: int) -> str:
    return f"{checkpoints_prefix(run_name)}/step_{step:08d}"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    uri: str
    model: dict
    optim: dict
    rng: list
    state: dict


def rng_state() -> dict:
    """This process's RNG states, as tensors and plain values (weights_only-loadable)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
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


def save(store: Store, run_name: str, step: int, model: dict, optim: dict, rng: list, state: dict) -> str:
    """Write one checkpoint (files, then manifest); returns its URI."""
    prefix = step_prefix(run_name, step)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmyard-ckpt-") as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("model.pt", "optim.pt", "rng.pt", "state.json")}
        torch.save(model, paths["model.pt"])
        torch.save(optim, paths["optim.pt"])
        torch.save(rng, paths["rng.pt"])
        with open(paths["state.json"], "w") as f:
            json.dump(state, f, indent=1)
        files = {}
        for name, path in paths.items():
            store.upload(path, f"{prefix}/{name}")
            files[name] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    manifest = {"step": step, "files": files, "created": time.time(), "save_s": round(time.perf_counter() - t0, 3)}
    store.write_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return store.uri(prefix)


def complete_steps(store: Store, run_name: str) -> list[int]:
    """Steps that have a manifest, oldest first."""
    steps = set()
    for key in store.list(checkpoints_prefix(run_name)):
        parent, _, name = key.rpartition("/")
        m = _STEP_DIR.search(parent)
        if name == MANIFEST and m:
            steps.add(int(m.group(1)))
    return sorted(steps)


def _load_step(store: Store, run_name: str, step: int, cache_dir: str) -> Checkpoint:
    prefix = step_prefix(run_name, step)
    manifest = json.loads(store.read_bytes(f"{prefix}/{MANIFEST}"))
    local = os.path.join(cache_dir, prefix)
    os.makedirs(local, exist_ok=True)
    paths = {}
    for name, meta in manifest["files"].items():
        path = store.local_path(f"{prefix}/{name}") or os.path.join(local, name)
        if store.local_path(f"{prefix}/{name}") is None:
            store.download(f"{prefix}/{name}", path)
        if not os.path.exists(path) or sha256_file(path) != meta["sha256"]:
            raise ValueError(f"{store.uri(prefix)}/{name} does not match its manifest checksum")
        paths[name] = path

    def load(name: str):
        return torch.load(paths[name], map_location="cpu", weights_only=True)

    with open(paths["state.json"]) as f:
        state = json.load(f)
    return Checkpoint(step=step, uri=store.uri(prefix), model=load("model.pt"), optim=load("optim.pt"),
                      rng=load("rng.pt"), state=state)


def load_latest(store: Store, run_name: str, cache_dir: str) -> Checkpoint | None:
    """The newest checkpoint whose files match its manifest; damaged ones are skipped with a warning."""
    for step in reversed(complete_steps(store, run_name)):
        try:
            return _load_step(store, run_name, step, cache_dir)
        except (ValueError, OSError, RuntimeError) as e:
            log.warning("checkpoint %s is damaged (%s); falling back to the previous one",
                        store.uri(step_prefix(run_name, step)), e)
    return None
