"""Checkpoint retention: one policy, applied to the store (local or S3).

Kept: the last `keep_last` complete checkpoints (at least 2), every multiple of `keep_every`, the best
(`keep_best`), protected steps, and checkpoints still held for evaluation; everything else is deleted,
its manifest first.

Design notes: docs/checkpoints.md, `lmyard/checkpoint/retention.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Set as AbstractSet

from lmyard.checkpoint.catalog import complete_steps, read_manifest
from lmyard.config import CheckpointConfig
from lmyard.layout import EVALUATED, RunLayout
from lmyard.run import Run


def protected_steps(run: Run) -> set[int]:
    key = run.layout.protected
    return set(json.loads(run.store.read_bytes(key)).get("steps", [])) if run.store.exists(key) else set()


def protect_checkpoint(run: Run, step: int) -> list[int]:
    """Add `step` to runs/<run>/protected.json ({"steps": [...]}): retention keeps what a registered model points
    to. All protected steps, sorted."""
    steps = protected_steps(run) | {step}
    run.store.write_bytes(run.layout.protected, json.dumps({"steps": sorted(steps)}).encode())
    return sorted(steps)


def mark_evaluated(run: Run, step: int, ok: bool) -> None:
    """Release checkpoint `step` for retention: its evaluation has ended (`ok`: it succeeded)."""
    run.store.write_bytes(run.layout.evaluated(step), json.dumps({"ok": ok, "time": time.time()}).encode())


def plan(
    steps: list[int],
    val_loss: dict[int, float | None],
    policy: CheckpointConfig,
    protected: AbstractSet[int] = frozenset(),
    held: AbstractSet[int] = frozenset(),
) -> tuple[list[int], list[int]]:
    """(kept, deleted) steps of `steps` under the policy; `protected` and `held` steps are always kept."""
    steps = sorted(steps)
    keep = set(steps[-policy.keep_last :]) | (set(steps) & (set(protected) | set(held)))
    if policy.keep_every:
        keep |= {s for s in steps if s % policy.keep_every == 0}
    scored = {s: v for s, v in val_loss.items() if s in steps and v is not None}
    if policy.keep_best and scored:
        keep.add(min(scored, key=lambda s: (scored[s], -s)))
    return sorted(keep), [s for s in steps if s not in keep]


def apply(run: Run, policy: CheckpointConfig, hold_for_eval: bool = False) -> list[int]:
    """Delete what the policy does not keep; returns the deleted steps.

    With `hold_for_eval`, checkpoints without an `evaluated.json` are kept (an evaluator still needs them).
    """
    store, layout = run.store, run.layout
    keys = store.list(layout.checkpoints)
    steps = complete_steps(run, keys)
    val = {s: read_manifest(run, s).val_loss for s in steps}
    held = set()
    if hold_for_eval:
        released = {RunLayout.step_of(k) for k in keys if k.endswith(f"/{EVALUATED}")}
        held = set(steps) - released
    _, delete = plan(steps, val, policy, protected_steps(run), held)
    for s in delete:
        store.delete(layout.manifest(s))
        store.delete(layout.step(s))
    if steps:  # leftovers of uploads cut short, older than the newest complete checkpoint
        partial = {found for k in keys if (found := RunLayout.step_of(k)) is not None}
        for s in sorted(partial - set(steps)):
            if s < steps[-1]:
                store.delete(layout.step(s))
                delete.append(s)
    return sorted(delete)
