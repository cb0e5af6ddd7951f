"""One pass over a sharded checkpoint's files while DCP loads them: read, hashed and deserialised at once.

DCP's FileSystemReader reads a file item by item (a seek, then `torch.load` of the slice) in its plan's
order, on the calling thread. Checking each file's sha256 before that read it twice, so a resume took
about twice the time of reading the bytes from the disk. `ReadAhead` instead reads each file front to
back exactly once: the spans DCP will ask for (its plan's items, sorted by offset), the gaps between them
and the tail. One thread reads, a second hashes what it read (so a disk slower than sha256 is the only
limit), and each span goes on to the loading thread (lmyard.checkpoint.dcp's reader), so reading and
hashing overlap the deserialising and the copies into the target.

Design notes: docs/checkpoints.md, `lmyard/checkpoint/readahead.py`.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import IO, cast

import torch

from lmyard.checkpoint.manifest import mismatch

CHUNK = 64 << 20  # bytes per read of a gap or tail (hashed, not kept)
LANES = 4  # files a rank reads and hashes at once (sha256 is one thread a file; a rank writes several)


@dataclass
class FileJob:
    name: str  # the file's name in DCP's index (relative to the dcp/ folder)
    path: str  # where it is read from
    uri: str  # how errors name it
    sha256: str  # what the manifest lists
    spans: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted, distinct
    verified: bool = False  # the whole file was hashed and matched


class _Buffer:
    """One of the ring's buffers: a uint8 tensor (pinned on CUDA) and, once its bytes were handed to copies
    on the GPU, the event after which it may be overwritten."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def ensure(self, size: int, pin: bool) -> None:
        if self.ready is not None:
            self.ready.synchronize()  # the copies out of it are done
            self.ready = None
        if self.data is None or self.data.numel() < size:
            self.data = None  # the old one freed first
            self.data = torch.empty(size, dtype=torch.uint8, pin_memory=pin)

    def view(self, n: int) -> memoryview:
        """The first n bytes, writable, for readinto and sha256."""
        assert self.data is not None
        return memory(self.data[:n])


class _Lane:
    """One reader thread and one hasher thread over some of the files, in order, with a ring of buffers of its
    own; hashed spans go to the ReadAhead's queue."""

    def __init__(self, ahead: ReadAhead, jobs: list[FileJob], depth: int):
        self.ahead, self.jobs = ahead, jobs
        self.phases: dict[str, float] = defaultdict(float)  # this lane's own: no two threads add to one
        self.hash_phases: dict[str, float] = defaultdict(float)
        self.free: queue.Queue[_Buffer] = queue.Queue()
        for _ in range(max(2, depth)):  # two at least: the loading thread holds one while the next is read
            self.free.put(_Buffer())
        self.raw: queue.Queue = queue.Queue()  # the reader's buffers, to the hasher
        self.reader = threading.Thread(target=self._read_files, name="lmyard-checkpoint-read", daemon=True)
        self.hasher = threading.Thread(target=self._run, name="lmyard-checkpoint-hash", daemon=True)

    def start(self) -> None:
        self.reader.start()
        self.hasher.start()

    def _read_files(self) -> None:
        """The reader: every byte of every file in order, as (job, span key or None for a gap, buffer, bytes in
        it), a (job, "end", None, 0) after each file, None after the last; an I/O error as it is."""
        try:
            if self.ahead.pin:  # a new thread starts on GPU 0: pinning there would make a context on it
                torch.cuda.set_device(self.ahead.device)
            for job in self.jobs:
                with open(job.path, "rb", buffering=0) as f:
                    pos = 0
                    for offset, length in job.spans:
                        while pos < offset:  # the gap before the span
                            if (got := self._read(f, job, None, min(CHUNK, offset - pos))) is None:
                                return
                            if not got:  # the file ends before the span
                                raise mismatch(job.uri)
                            pos += got
                        if pos != offset or self._read(f, job, (job.name, offset, length), length) != length:
                            raise mismatch(job.uri)
                        pos += length
                    while got := self._read(f, job, None, CHUNK):  # the tail
                        pass
                    if got is None:
                        return
                self.raw.put((job, "end", None, 0))
            self.raw.put(None)
        except BaseException as e:
            self.raw.put(e)

    def _read(self, f, job: FileJob, key, n: int) -> int | None:
        """Up to n bytes into a free buffer, on to the hasher: how many (0 at the end of the file; fewer than n
        only there); None once close() was called."""
        buf = self.ahead._get(self.free)
        if buf is None:
            return None
        t0 = time.perf_counter()
        buf.ensure(self.ahead.size, self.ahead.pin)
        t1 = time.perf_counter()
        view, got = buf.view(n), 0
        while got < n and (k := f.readinto(view[got:])):
            got += k
        self.phases["reuse"] += t1 - t0
        self.phases["read"] += time.perf_counter() - t1
        if got == 0 or (key is not None and got < n):  # the end of the file (early for a span: raised above)
            self.free.put(buf)
            return got
        self.raw.put((job, key, buf, got))
        return got

    def _run(self) -> None:
        """The hasher: each file's sha256 over the reader's bytes, the spans passed on to the loading thread
        (with the lane, to which their buffer goes back); None after this lane's last file."""
        h, out = hashlib.sha256(), self.ahead._q
        try:
            while (got := self.ahead._get(self.raw)) is not None:
                if isinstance(got, BaseException):
                    raise got
                job, key, buf, n = got
                if key == "end":
                    if h.hexdigest() != job.sha256:
                        raise mismatch(job.uri)
                    job.verified, h = True, hashlib.sha256()
                    continue
                t0 = time.perf_counter()
                h.update(buf.view(n))
                self.hash_phases["hash"] += time.perf_counter() - t0
                if key is None:
                    self.free.put(buf)
                else:
                    out.put((key, buf, n, self))
            out.put(None)
        except BaseException as e:  # the loading thread's next span raises it
            self.ahead._error = self.ahead._error or e
            out.put(e)


class ReadAhead:
    """Reads `jobs` in `lanes` lanes at once (a file's bytes in order within its lane); `take(name, offset,
    length)` gives a span's bytes in the jobs' order (one lane only), `next_span()` the next span hashed in
    any lane.

    `device`: the CUDA device the spans are copied to (buffers pinned, reuse waits for the copies), or None.
    `phases` (after finish) has the seconds per phase, summed over the lanes: read, hash, `reuse` (making a
    buffer, or waiting for the copies out of it) and `wait` (the loading thread waiting for a span)."""

    def __init__(self, jobs: list[FileJob], depth: int = 4, device: torch.device | None = None, lanes: int = 1):
        self.jobs, self.device = jobs, device
        self.pin = device is not None and device.type == "cuda"
        self.size = max([CHUNK] + [length for job in jobs for _, length in job.spans])
        self.phases: dict[str, float] = defaultdict(float)
        self._q: queue.Queue = queue.Queue()  # hashed spans of every lane, to the loading thread
        self._stop = threading.Event()
        self._current: tuple[tuple[str, int, int], _Buffer, int, _Lane] | None = None
        self._error: BaseException | None = None
        n = max(1, min(lanes, len(jobs)))
        per_lane = depth if n == 1 else 2  # buffers a lane: reading one while the other is hashed or copied
        self._lanes = [_Lane(self, jobs[i::n], per_lane) for i in range(n)]  # files dealt round-robin
        self._open = n  # lanes that have not said they are done
        for lane in self._lanes:
            lane.start()

    def take(self, name: str, offset: int, length: int) -> torch.Tensor:
        """The bytes of one span as a uint8 tensor, valid until the next take() of another span (asked for
        again: the same bytes); a damaged file's error as it is found. In the jobs' order: one lane only."""
        assert len(self._lanes) == 1, "take() reads in the jobs' order: a ReadAhead of one lane"
        key = (name, offset, length)
        while self._current is None or self._current[0] != key:
            got = self.next_span()
            if got is None:  # every file read: DCP asked for a span its plan did not list
                raise RuntimeError(f"checkpoint read of a span not planned: {key}")
            if got[0][0] == name and got[0][1] > offset:  # went past it: DCP asked out of the sorted order
                raise RuntimeError(f"checkpoint read out of order: {key} after {got[0]}")
        _, buf, n, _ = self._current
        assert buf.data is not None
        return buf.data[:n]

    def next_span(self) -> tuple[tuple[str, int, int], torch.Tensor] | None:
        """The next span hashed in any lane, as ((name, offset, length), its bytes as a uint8 tensor, valid until
        the next call); None once every lane is done; a damaged file's error as it is found."""
        self._release()
        t0 = time.perf_counter()
        while self._open:
            got = self._q.get()
            if isinstance(got, BaseException):
                raise got
            if got is None:
                self._open -= 1
                continue
            self._current = got
            self.phases["wait"] += time.perf_counter() - t0
            key, buf, n, _ = got
            return key, buf.data[:n]
        return None

    def finish(self) -> None:
        """After the last span: wait for every file's tail to be hashed (and, on CUDA, for the copies out of the
        buffers); DamagedCheckpoint naming a file that does not match its manifest."""
        for lane in self._lanes:
            lane.hasher.join()
        self._release()
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()
        for lane in self._lanes:
            for phases in (lane.phases, lane.hash_phases):
                for k, v in phases.items():
                    self.phases[k] += v
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop reading (the load failed): the threads end at their next buffer."""
        self._stop.set()
        for lane in self._lanes:
            lane.hasher.join()
            lane.reader.join()

    def _release(self) -> None:
        """The loading thread is done with the current span: its buffer back to its lane's reader (on CUDA once
        the copies issued from it have run)."""
        if self._current is not None:
            buf, lane = self._current[1], self._current[3]
            if self.pin:
                buf.ready = torch.cuda.Event()
                buf.ready.record(torch.cuda.current_stream(self.device))
            lane.free.put(buf)
            self._current = None

    def _get(self, q: queue.Queue):
        """The queue's next item; None once close() was called."""
        while not self._stop.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                pass
        return None


def memory(t: torch.Tensor) -> memoryview:
    """A contiguous uint8 CPU tensor's bytes, writable, without a copy (Tensor.numpy needs numpy)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


class _SpanFile(io.RawIOBase):
    """A read-only file over a span's bytes without copying them (io.BytesIO copies a memoryview), for
    torch's zip reader, which reads the archive's directory and its pickle from it."""

    def __init__(self, view: memoryview):
        self.mv, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset + (0, self.pos, len(self.mv))[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.mv) - self.pos))
        b[:n] = self.mv[self.pos : self.pos + n]
        self.pos += n
        return n


def tensor_in(span: torch.Tensor) -> torch.Tensor:
    """The tensor DCP saved in a span (torch.save of one tensor), as a view of the span's bytes.

    The archive's pickle goes through torch's weights-only unpickler (what torch.load(weights_only=True)
    uses: tensors and plain values, never arbitrary objects); its storage records are slices of the span
    where the archive keeps them (torch.load's mmap path, `overall_storage`), instead of new storages
    read from a file-like object. Anything else (an archive this does not read) goes to torch.load."""
    mv = memory(span)
    try:
        with torch.serialization._open_zipfile_reader(cast(IO[bytes], _SpanFile(mv))) as archive:
            storage = span.untyped_storage()[span.storage_offset() :]
            return torch.serialization._load(
                archive, "cpu", torch._weights_only_unpickler, overall_storage=storage, encoding="utf-8"
            )
    except Exception:  # not the layout expected: torch.load decides (and raises what is wrong)
        return torch.load(io.BytesIO(bytes(mv)), map_location="cpu", weights_only=True)
