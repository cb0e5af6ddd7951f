"""What checkpoints a run has, read without torch (the flow's process never imports it).

A checkpoint exists once its manifest (lmyard.checkpoint.manifest.Manifest) does: the
commit writes it last (lmyard.checkpoint.commit). `state.json` is a
lmyard.checkpoint.schema.CheckpointState. Keys come from lmyard.layout.RunLayout.
"""

from __future__ import annotations

import time

from pydantic import ValidationError

from lmyard.checkpoint.manifest import DamagedCheckpoint, Manifest
from lmyard.checkpoint.schema import CheckpointState
from lmyard.layout import MANIFEST, RunLayout
from lmyard.store import Store


def checkpoints_prefix(run_name: str) -> str:
    return RunLayout(run_name).checkpoints


def step_prefix(run_name: str, step: int) -> str:
    return RunLayout(run_name).step(step)


def complete_steps(store: Store, run_name: str, keys: list[str] | None = None) -> list[int]:
    """Steps that have a manifest, oldest first (`keys`: a listing of the checkpoints prefix already made)."""
    steps = set()
    for key in store.list(checkpoints_prefix(run_name)) if keys is None else keys:
        step = RunLayout.step_of(key)
        if key.endswith(f"/{MANIFEST}") and step is not None and key == RunLayout(run_name).manifest(step):
            steps.add(step)
    return sorted(steps)


def read_manifest(store: Store, run_name: str, step: int) -> Manifest:
    """The manifest of checkpoint `step`; DamagedCheckpoint when it is not one lmyard wrote (a failed read raises
    as it is: that is not damage)."""
    key = RunLayout(run_name).manifest(step)
    data = store.read_bytes(key)
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as e:
        raise DamagedCheckpoint(f"{store.uri(key)} is not a checkpoint manifest: {str(e).splitlines()[0]}") from None


def read_state(store: Store, run_name: str, step: int) -> CheckpointState:
    return CheckpointState.model_validate_json(store.read_bytes(RunLayout(run_name).step_file(step, "state.json")))


def verify(store: Store, run_name: str, step: int) -> dict:
    """Check that every file of checkpoint `step` is in the store with the size its manifest records;
    where it landed, its bytes, and how long serializing and uploading took. ValueError names a mismatch."""
    layout = RunLayout(run_name)
    manifest = read_manifest(store, run_name, step)
    for name, meta in manifest.files.items():
        found = store.size(layout.step_file(step, name))
        if found != meta.bytes:
            raise ValueError(
                f"{store.uri(layout.step_file(step, name))} holds {found} bytes; its manifest says {meta.bytes}"
            )
    return {
        "step": step,
        "uri": store.uri(layout.step(step)),
        "format": manifest.format,
        "files": len(manifest.files),
        "bytes": manifest.bytes,
        "serialize_s": manifest.serialize_s,
        "upload_s": manifest.upload_s,
        "committed": manifest.committed,
    }


def damaged(store: Store, run_name: str) -> dict[int, list[str]]:
    """step -> the URIs of its checkpoints moved aside as damaged (`quarantine`), oldest first."""
    found: dict[int, set[str]] = {}
    for key in store.list(RunLayout(run_name).damaged_root):
        if (where := RunLayout.damaged_step_of(key)) is not None:
            found.setdefault(where[0], set()).add(store.uri(where[1]))
    return {step: sorted(uris) for step, uris in found.items()}  # the folder names end with UTC time: sortable


def quarantine(store: Store, run_name: str, step: int) -> str:
    """Move a damaged checkpoint aside (runs/<run>/damaged/step_N-<time>/), so its step can be written again
    and nothing is ever rewritten in place; returns where it went."""
    layout = RunLayout(run_name)
    dest = layout.damaged(step, time.strftime("%Y%m%dT%H%M%S", time.gmtime()))
    src = layout.step(step)
    for key in store.list(src):
        store.copy(key, dest + key.removeprefix(src))
    store.delete(layout.manifest(step))  # first: a half-moved checkpoint never looks complete
    store.delete(src)
    print(f"moved the damaged checkpoint step {step} to {store.uri(dest)}", flush=True)
    return store.uri(dest)
