"""One pass over a sharded checkpoint's files while DCP loads them: read, hashed and deserialised at once.

DCP's FileSystemReader reads a file item by item (a seek, then `torch.load` of the slice) in its plan's
order, on the calling thread. Checking each file's sha256 before that read it twice, so a resume took
about twice the time of reading the bytes from the disk. `ReadAhead` instead reads each file front to
back exactly once: the spans DCP will ask for (its plan's items, sorted by offset), the gaps between them
and the tail. One thread reads, a second hashes what it read (so a disk slower than sha256 is the only
limit), and each span's bytes go on to DCP through bounded queues (`depth` spans each): reading and
hashing overlap DCP's deserialising and its copies to the GPU, and memory stays at a few items.

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

from lmyard.checkpoint.manifest import mismatch

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
        self._raw: queue.Queue = queue.Queue(maxsize=depth)  # the reader's bytes, to the hasher
        self._reader = threading.Thread(target=self._read_files, name="lmyard-checkpoint-read", daemon=True)
        self._thread = threading.Thread(target=self._run, name="lmyard-checkpoint-hash", daemon=True)
        self._reader.start()
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
        self._current = None  # the last span's bytes: DCP has copied them
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop reading (DCP failed): the thread ends at its next span."""
        self._stop.set()
        self._thread.join()
        self._reader.join()

    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _get_raw(self):
        """The reader's next item; None once close() was called."""
        while not self._stop.is_set():
            try:
                return self._raw.get(timeout=0.1)
            except queue.Empty:
                pass
        return None

    def _read_files(self) -> None:
        """The reader: every byte of every file in order, as (job, span key or None for a gap, bytes), a
        (job, "end", b"") after each file, None after the last; an I/O error as it is."""
        try:
            for job in self.jobs:
                with open(job.path, "rb", buffering=0) as f:
                    pos = 0
                    for offset, length in job.spans:
                        for gap in _chunks(f, pos, offset):
                            if not self._put(self._raw, (job, None, gap)):
                                return
                            pos += len(gap)
                        data = _read_exactly(f, length)
                        if len(data) < length or pos != offset:
                            raise mismatch(job.uri)
                        if not self._put(self._raw, (job, (job.name, offset, length), data)):
                            return
                        pos += length
                    for tail in _chunks(f, pos, None):
                        if not self._put(self._raw, (job, None, tail)):
                            return
                if not self._put(self._raw, (job, "end", b"")):
                    return
            self._put(self._raw, None)
        except BaseException as e:
            self._put(self._raw, e)

    def _run(self) -> None:
        """The hasher: each file's sha256 over the reader's bytes, the spans passed on to take()."""
        h = hashlib.sha256()
        try:
            while (got := self._get_raw()) is not None:
                if isinstance(got, BaseException):
                    raise got
                job, key, data = got
                if key == "end":
                    if h.hexdigest() != job.sha256:
                        raise mismatch(job.uri)
                    job.verified, h = True, hashlib.sha256()
                    continue
                h.update(data)
                if key is not None and not self._put(self._q, (key, data)):
                    return
            self._put(self._q, None)
        except BaseException as e:  # DCP's next take() raises it
            self._error = e
            self._put(self._q, e)


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) == n or not data:
        return data
    parts = [data]
    while (got := sum(map(len, parts))) < n and (more := f.read(n - got)):
        parts.append(more)
    return b"".join(parts)


def _chunks(f, pos: int, until: int | None):
    """The file's bytes from `pos` up to `until` (the end with None), CHUNK at a time."""
    while until is None or pos < until:
        data = f.read(CHUNK if until is None else min(CHUNK, until - pos))
        if not data:
            return
        pos += len(data)
        yield data
