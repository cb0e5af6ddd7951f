"""What checkpoints a run has, read without torch (the flow's process never imports it).

A checkpoint exists once its manifest (lmyard.checkpoint.manifest.Manifest) does: the
commit writes it last (lmyard.checkpoint.commit). `state.json` is a
lmyard.checkpoint.schema.CheckpointState. Each function takes the run's handle (lmyard.run.Run).
"""

from __future__ import annotations

import time

from pydantic import ValidationError

from lmyard.checkpoint.manifest import DamagedCheckpoint, Manifest
from lmyard.checkpoint.schema import CheckpointState
from lmyard.layout import MANIFEST, RunLayout
from lmyard.run import Run


def complete_steps(run: Run, keys: list[str] | None = None) -> list[int]:
    """Steps that have a manifest, oldest first (`keys`: a listing of the checkpoints prefix already made)."""
    steps = set()
    for key in run.store.list(run.layout.checkpoints) if keys is None else keys:
        step = RunLayout.step_of(key)
        if key.endswith(f"/{MANIFEST}") and step is not None and key == run.layout.manifest(step):
            steps.add(step)
    return sorted(steps)


def read_manifest(run: Run, step: int) -> Manifest:
    """The manifest of checkpoint `step`; DamagedCheckpoint when it is not one lmyard wrote (a failed read raises
    as it is: that is not damage)."""
    key = run.layout.manifest(step)
    data = run.store.read_bytes(key)
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as e:
        raise DamagedCheckpoint(f"{run.uri(key)} is not a checkpoint manifest: {str(e).splitlines()[0]}") from None


def read_state(run: Run, step: int) -> CheckpointState:
    return CheckpointState.model_validate_json(run.store.read_bytes(run.layout.step_file(step, "state.json")))


def verify(run: Run, step: int) -> dict:
    """Check that every file of checkpoint `step` is in the store with the size its manifest records;
    where it landed, its bytes, and how long serializing and uploading took. ValueError names a mismatch."""
    layout = run.layout
    manifest = read_manifest(run, step)
    for name, meta in manifest.files.items():
        found = run.store.size(layout.step_file(step, name))
        if found != meta.bytes:
            raise ValueError(
                f"{run.uri(layout.step_file(step, name))} holds {found} bytes; its manifest says {meta.bytes}"
            )
    return {
        "step": step,
        "uri": run.uri(layout.step(step)),
        "format": manifest.format,
        "files": len(manifest.files),
        "bytes": manifest.bytes,
        "serialize_s": manifest.serialize_s,
        "upload_s": manifest.upload_s,
        "committed": manifest.committed,
    }


def damaged(run: Run) -> dict[int, list[str]]:
    """step -> the URIs of its checkpoints moved aside as damaged (`quarantine`), oldest first."""
    found: dict[int, set[str]] = {}
    for key in run.store.list(run.layout.damaged_root):
        if (where := RunLayout.damaged_step_of(key)) is not None:
            found.setdefault(where[0], set()).add(run.uri(where[1]))
    return {step: sorted(uris) for step, uris in found.items()}  # the folder names end with UTC time: sortable


def quarantine(run: Run, step: int) -> str:
    """Move a damaged checkpoint aside (runs/<run>/damaged/step_N-<time>/), so its step can be written again
    and nothing is ever rewritten in place; returns where it went."""
    store, layout = run.store, run.layout
    dest = layout.damaged(step, time.strftime("%Y%m%dT%H%M%S", time.gmtime()))
    src = layout.step(step)
    for key in store.list(src):
        store.copy(key, dest + key.removeprefix(src))
    store.delete(layout.manifest(step))  # first: a half-moved checkpoint never looks complete
    store.delete(src)
    print(f"moved the damaged checkpoint step {step} to {store.uri(dest)}", flush=True)
    return store.uri(dest)
