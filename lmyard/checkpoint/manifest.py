"""The manifest of a checkpoint: one schema for both formats, written last.

    runs/<run>/checkpoints/step_NNNNNNNN/manifest.json

A checkpoint exists once its manifest does. The manifest lists every file of the
checkpoint with its size and sha256 (a loader checks each file before reading
it), the format that wrote the files (`full`: model.pt optim.pt rng.pt
state.json; `dcp`: dcp/ shards of every rank, rng.pt, state.json), the world
size that wrote it and the timings of the save. Torch-free: the flow's process
reads it (lmyard.checkpoint.catalog).
"""

from __future__ import annotations

import builtins
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lmyard.paths import sha256_file

Format = Literal["full", "dcp"]


class DamagedCheckpoint(ValueError):
    """A checkpoint's files do not match its manifest, or do not load: it is skipped, never repaired."""


class FileMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bytes: int
    sha256: str


class Manifest(BaseModel):
    """`manifest.json` of a checkpoint (either format)."""

    model_config = ConfigDict(extra="ignore")  # older manifests may carry fields no longer written
    format: Format = Field("full", description="`full`: whole state dicts of rank 0; `dcp`: every rank's shards.")
    step: int
    val_loss: float | None = Field(None, description="Validation loss measured at this step, else null.")
    world_size: int | None = Field(None, description="Ranks of the run that saved it.")
    files: dict[str, FileMeta] = Field(description="Every file of the checkpoint (relative key): size and sha256.")
    serialize_s: float | None = Field(None, description="Seconds to write the files to the staging folder.")
    upload_s: float | None = Field(None, description="Seconds to upload them.")
    committed: float | None = Field(None, description="Unix time the manifest was written.")

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.files.values())

    def to_bytes(self) -> builtins.bytes:  # the property above shadows the type in the class body
        return self.model_dump_json(indent=1).encode()


def file_meta(path: str) -> FileMeta:
    return FileMeta(bytes=os.path.getsize(path), sha256=sha256_file(path))


def check_file(manifest: Manifest, name: str, path: str, uri: str) -> str:
    """`path` if it holds the bytes the manifest lists for `name`, else DamagedCheckpoint naming `uri`."""
    meta = manifest.files.get(name)
    if meta is None:
        raise DamagedCheckpoint(f"{uri} is not in the checkpoint's manifest")
    if not os.path.exists(path) or sha256_file(path) != meta.sha256:
        raise mismatch(uri)
    return path


def mismatch(uri: str) -> DamagedCheckpoint:
    """The error for a file whose bytes are not those its manifest lists."""
    return DamagedCheckpoint(f"{uri} does not match its manifest checksum")
