"""The manifest of a checkpoint: one schema for both formats, written last.

    runs/<run>/checkpoints/step_NNNNNNNN/manifest.json

A checkpoint exists once its manifest does. It lists every file with its size and
sha256, and for a file over one piece (PIECE_BYTES) each piece's sha256, which a
loader checks on several threads (one sha256 of llama-1b's 9.2 GB optimizer file
takes 7.5 s); the format that wrote the files (`full`: model.pt optim.pt rng.pt
state.json; `dcp`: dcp/ shards of every rank, rng.pt, state.json), the world size
that wrote it and the save's timings. Torch-free: the flow's process reads it.
"""

from __future__ import annotations

import builtins
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lmyard.paths import sha256_file

Format = Literal["full", "dcp"]
PIECE_BYTES = 256 << 20  # a file over this is also hashed piece by piece: the check runs on HASH_THREADS
HASH_THREADS = 8


class DamagedCheckpoint(ValueError):
    """A checkpoint's files do not match its manifest, or do not load: it is skipped, never repaired."""


class FileMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bytes: int
    sha256: str
    pieces: list[str] | None = Field(None, description="sha256 of each PIECE_BYTES piece (a file over one piece).")


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
    """Size and sha256 of a written file; over one piece, each piece's too (hashed beside the whole)."""
    size = os.path.getsize(path)
    if size <= PIECE_BYTES:
        return FileMeta(bytes=size, sha256=sha256_file(path))
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        whole = pool.submit(sha256_file, path)
        return FileMeta(bytes=size, sha256=whole.result(), pieces=_piece_hashes(path, size, pool))


class StreamHash:
    """`file_meta` of bytes as they are written, so the file is never read back: the whole sha256 and each
    PIECE_BYTES piece's, fed by `update` and `update_pieces` (two threads may run them at once; hashlib releases
    the GIL on large updates)."""

    def __init__(self) -> None:
        self.size, self.whole = 0, hashlib.sha256()
        self.done: list[str] = []  # the finished pieces' sha256
        self.piece, self.in_piece = hashlib.sha256(), 0

    def update(self, data: memoryview | builtins.bytes) -> None:
        self.whole.update(data)
        self.size += memoryview(data).nbytes

    def update_pieces(self, data: memoryview | builtins.bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), PIECE_BYTES - self.in_piece)
            self.piece.update(view[:take])
            self.in_piece, view = self.in_piece + take, view[take:]
            if self.in_piece == PIECE_BYTES:
                self.done.append(self.piece.hexdigest())
                self.piece, self.in_piece = hashlib.sha256(), 0

    def meta(self) -> FileMeta:
        """The same FileMeta as `file_meta` of the written file."""
        if self.size <= PIECE_BYTES:
            return FileMeta(bytes=self.size, sha256=self.whole.hexdigest())
        pieces = self.done + ([self.piece.hexdigest()] if self.in_piece else [])
        return FileMeta(bytes=self.size, sha256=self.whole.hexdigest(), pieces=pieces)


def _piece_hashes(path: str, size: int, pool: ThreadPoolExecutor) -> list[str]:
    return list(pool.map(lambda i: _piece_sha256(path, i), range(-(-size // PIECE_BYTES))))


def _piece_sha256(path: str, index: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(index * PIECE_BYTES)
        left = PIECE_BYTES
        while left and (block := f.read(min(left, 1 << 22))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def matches(path: str, meta: FileMeta) -> bool:
    """Whether the file at `path` holds the bytes `meta` lists: piece by piece on HASH_THREADS where the
    manifest lists pieces, else one sha256."""
    if not os.path.exists(path) or os.path.getsize(path) != meta.bytes:
        return False
    if not meta.pieces:
        return sha256_file(path) == meta.sha256
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        return _piece_hashes(path, meta.bytes, pool) == meta.pieces


def check_file(manifest: Manifest, name: str, path: str, uri: str) -> str:
    """`path` if it holds the bytes the manifest lists for `name`, else DamagedCheckpoint naming `uri`."""
    meta = manifest.files.get(name)
    if meta is None:
        raise DamagedCheckpoint(f"{uri} is not in the checkpoint's manifest")
    if not matches(path, meta):
        raise mismatch(uri)
    return path


def mismatch(uri: str) -> DamagedCheckpoint:
    """The error for a file whose bytes are not those its manifest lists."""
    return DamagedCheckpoint(f"{uri} does not match its manifest checksum")
