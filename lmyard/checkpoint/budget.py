"""The disk budget of a run's checkpoints, checked before the first step: a plan that cannot fit is a UserError.

Design notes: docs/checkpoints.md, `lmyard/checkpoint/budget.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.models import registry
from lmyard.run import Run

MIB = 2**20


def checkpoint_bytes(cfg: RunConfig, fields: dict) -> int:
    """Bytes of one whole checkpoint of the model of `fields` (`model_spec`'s dict, or `resolve`'s with arch)."""
    low = cfg.train.parallel == "fsdp" and cfg.train.fsdp_param_dtype == "bfloat16"
    return registry.parameters(fields) * (14 if low else 12)


def made(cfg: RunConfig) -> int:
    """Checkpoints the run writes at all: every checkpoint.interval-th step, and the last step."""
    return max(1, -(-cfg.train.max_steps // cfg.checkpoint.interval))


def kept(cfg: RunConfig) -> int:
    """Checkpoints retention keeps in the store at most."""
    c = cfg.checkpoint
    every = cfg.train.max_steps // c.keep_every if c.keep_every else 0
    return min(c.keep_last + int(c.keep_best) + every, made(cfg))


def _fewer(cfg: RunConfig, count: int) -> tuple[int, str]:
    """`count` copies capped at the checkpoints the run writes, and what the line adds when the cap applies."""
    n = made(cfg)
    if count <= n:
        return count, ""
    return (
        n,
        f", at most {n} written (train.max_steps={cfg.train.max_steps}, checkpoint.interval={cfg.checkpoint.interval})",
    )


@dataclass(frozen=True)
class Disk:
    """One filesystem the run writes checkpoints to: what it needs there and what it has."""

    folder: str
    needed: int
    free: int  # free bytes plus what the run holds there already
    what: str  # the copies counted, as the line says them
    fix: str  # the keys to change


def _held(folder: str | None) -> int:
    """Bytes of the files under `folder` (none when it is absent)."""
    total = 0
    for root, _, files in os.walk(folder or ""):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _device(folder: str) -> tuple[int, int]:
    """(filesystem id, free bytes) of `folder`, or of its nearest existing parent."""
    probe = folder
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return os.stat(probe).st_dev, st.f_bavail * st.f_frsize


def disks(cfg: RunConfig, run: Run, size: int, node_share: int) -> list[Disk]:
    """The disks this node writes checkpoints to, with their needs: the cache's staging (`run.cache`), and a
    local store. `size`: one whole checkpoint's bytes; `node_share`: the bytes of one this node stages (0: none)."""
    store, cache_dir = run.store, run.cache
    c, staging = cfg.checkpoint, os.path.join(cache_dir, "staging", run.name)
    pending = f"checkpoint.max_pending={c.max_pending} pending + 1 being staged"
    stored = f"{kept(cfg)} kept (checkpoint.keep_last={c.keep_last}, keep_best, keep_every)"
    fix_cache = "lower checkpoint.max_pending or point LMYARD_CACHE at a bigger disk"
    fix_store = "lower checkpoint.keep_last (or keep_every, keep_best) or point `store` at a bigger disk"
    cache_dev, cache_free = _device(staging)
    staged, capped = _fewer(cfg, c.max_pending + 1)
    cache = Disk(
        f"LMYARD_CACHE {cache_dir}",
        staged * node_share,
        cache_free + _held(staging),
        pending + capped,
        fix_cache,
    )
    local = store.local_path(run.layout.checkpoints)
    if local is None:
        return [cache] if node_share else []
    store_dev, store_free = _device(local)
    if store_dev == cache_dev:  # one disk: the commit is a rename
        capped = _fewer(cfg, kept(cfg) + c.max_pending + 1)[1]
        return [
            Disk(
                f"LMYARD_CACHE {cache_dir} and the store {store.local_path('')}",
                min(kept(cfg) * size + cache.needed, made(cfg) * size),  # no copy is larger than a whole one
                cache.free + _held(local),
                f"{stored} + {pending}{capped}",
                f"{fix_store}, {fix_cache}",
            )
        ]
    copies, capped = _fewer(cfg, kept(cfg) + 1)
    held = Disk(
        f"the store {store.local_path('')}",
        copies * size,
        store_free + _held(local),
        f"{stored} + 1 being committed{capped}",
        fix_store,
    )
    return [held, cache] if node_share else [held]


def check(cfg: RunConfig, run: Run, fields: dict, *, node_share: float) -> None:
    """A UserError, one line, when the checkpoints of `cfg` cannot fit the disks this node writes them to (see
    the module doc). `node_share`: the fraction of a checkpoint this node stages (0 to 1)."""
    size = checkpoint_bytes(cfg, fields)
    for disk in disks(cfg, run, size, int(size * node_share)):
        if disk.needed > disk.free:
            raise UserError(
                f"checkpoints do not fit {disk.folder}: {disk.needed / MIB:,.1f} MiB needed ({disk.what}, "
                f"{size / MIB:,.1f} MiB each) but {disk.free / MIB:,.1f} MiB free; {disk.fix}"
            )
