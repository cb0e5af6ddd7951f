"""One pass over a sharded checkpoint's files while DCP loads them: read, hashed and deserialised at once.

DCP's FileSystemReader reads a file item by item (a seek, then `torch.load` of the slice) in its plan's
order, on the calling thread. Checking each file's sha256 before that read it twice, so a resume took
about twice the time of reading the bytes from the disk. `ReadAhead` instead reads each file front to
back exactly once, in a thread of its own: the spans DCP will ask for (its plan's items, sorted by offset),
the gaps between them and the tail, all into one sha256. Each span's bytes go to DCP through a bounded
queue (`depth` spans), so reading and hashing overlap DCP's deserialising and its copies to the GPU, and
memory stays at a few items.

A file whose bytes differ from the manifest is found when its last byte has been read, after DCP may have
copied some of its tensors into the target. That is harmless: the DamagedCheckpoint makes the resume fall
back to an older checkpoint (lmyard.checkpoint.resume), whose load overwrites them.
"""

from __future__ import annotations

import hashlib
import io
import queue
import threading
from dataclasses import dataclass, field

from lmyard.checkpoint.manifest import DamagedCheckpoint

CHUNK = 64 << 20  # bytes per read of a gap or tail (hashed, not kept)


@dataclass
class FileJob:
    name: str  # the file's name in DCP's index (relative to the dcp/ folder)
    path: str  # where it is read from
    uri: str  # how errors name it
    sha256: str  # what the manifest lists
    spans: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted, distinct
    verified: bool = False  # the whole file was hashed and matched


class ReadAhead:
    """Reads `jobs` in order in a thread; `take(name, offset, length)` gives a span's bytes, in that order."""

    def __init__(self, jobs: list[FileJob], depth: int = 4):
        self.jobs = jobs
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._current: tuple[tuple[str, int, int], bytes] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lmyard-checkpoint-read", daemon=True)
        self._thread.start()

    def take(self, name: str, offset: int, length: int) -> io.BytesIO:
        """The bytes of one span (asked for again: the same bytes); a damaged file's error as it is found."""
        key = (name, offset, length)
        while self._current is None or self._current[0] != key:
            got = self._q.get()
            if isinstance(got, BaseException):
                raise got
            if got is None:  # every file read: DCP asked for a span its plan did not list
                raise RuntimeError(f"checkpoint read of a span not planned: {key}")
            self._current = got
            if got[0][0] == name and got[0][1] > offset:  # went past it: DCP asked out of the sorted order
                raise RuntimeError(f"checkpoint read out of order: {key} after {got[0]}")
        return io.BytesIO(self._current[1])

    def finish(self) -> None:
        """After DCP's reads: wait for every file's tail to be hashed; DamagedCheckpoint naming a file that
        does not match its manifest."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop reading (DCP failed): the thread ends at its next span."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._q.get(timeout=0.1)
            except queue.Empty:
                pass

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _run(self) -> None:
        try:
            for job in self.jobs:
                if not self._read(job):
                    return
            self._put(None)
        except BaseException as e:  # an I/O error: DCP's next take() raises it
            self._error = e
            self._put(e)

    def _read(self, job: FileJob) -> bool:
        h, pos = hashlib.sha256(), 0
        with open(job.path, "rb", buffering=0) as f:
            for offset, length in job.spans:
                pos = _skip(f, h, pos, offset)
                data = _read_exactly(f, length)
                if len(data) < length or pos != offset:
                    raise DamagedCheckpoint(f"{job.uri} does not match its manifest checksum")
                h.update(data)
                pos += length
                if not self._put(((job.name, offset, length), data)):
                    return False
            _skip(f, h, pos, None)
        if h.hexdigest() != job.sha256:
            raise DamagedCheckpoint(f"{job.uri} does not match its manifest checksum")
        job.verified = True
        return True


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) == n or not data:
        return data
    parts = [data]
    while (got := sum(map(len, parts))) < n and (more := f.read(n - got)):
        parts.append(more)
    return b"".join(parts)


def _skip(f, h, pos: int, until: int | None) -> int:
    """Hash the bytes from `pos` up to `until` (the end of the file with None); the position reached."""
    while until is None or pos < until:
        data = f.read(CHUNK if until is None else min(CHUNK, until - pos))
        if not data:
            break
        h.update(data)
        pos += len(data)
    return pos
