"""One writer per lineage: a lease on `runs/<run_name>/lease.json` in the store (`RunLayout.lease`).

A run takes the lease before it opens the lineage and gives it back at the end.
The lease names its holder (host, pid, flow run, since when) and carries a
heartbeat, renewed every ttl/3 by a background thread. A lease whose heartbeat
is older than its ttl (or whose holder is a dead process on this host) is
expired and may be taken over: a crashed holder does not block the lineage
for longer than the ttl. A second run waits up to `wait_s` for the lease,
then refuses with one line naming the holder.

Design notes: docs/tracking.md, `lmyard/tracking/lease.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from lmyard.errors import LeaseLost, UserError
from lmyard.run import Run
from lmyard.store import LocalStore

FIELDS = ("token", "heartbeat", "ttl_s")  # what a lease record needs to be judged (no epoch: an older lmyard's, 0)
STALE = 2 / 3  # of the ttl: a holder whose heartbeat is older stops writing (see the module doc)


class LeaseRef(BaseModel):
    """The lineage's lease as its holder took it, as it travels to the trainer (lmyard.stages.TrainSpec): the
    trainer's rank 0 stops, and its commits are refused, once the lease record is no longer this one."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    token: str
    epoch: int = Field(description="One more than the lease record it replaced (1 for a fresh lease).")
    ttl_s: float


def parse(data: bytes, uri: str) -> dict:
    """A lease record from the bytes of `uri`; a UserError naming the file and the fix when it is corrupt."""
    try:
        record = json.loads(data)
        missing = [k for k in FIELDS if k not in record] if isinstance(record, dict) else list(FIELDS)
        if not missing:
            float(record["heartbeat"]), float(record["ttl_s"]), int(record.setdefault("epoch", 0))
    except (ValueError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        missing, problem = [], f"not a lease record: {type(e).__name__}"
    else:
        problem = f"missing {', '.join(missing)}" if missing else ""
    if problem:
        raise UserError(
            f"lease {uri} is corrupt ({problem}); delete it once no run of this lineage is running, then rerun"
        )
    return record


class _LocalLease:
    """Compare-and-swap on a lease file; the tag is the SHA-256 of its bytes."""

    def __init__(self, store: LocalStore, key: str):
        path = store.local_path(key)
        assert path is not None  # a local store maps every key to a file
        self.path: str = path
        self.uri = store.uri(key)
        self.lock = os.path.join(os.path.dirname(self.path), ".lease.lock")
        self.made_folder = False  # this process created the run's folder for its lease (see `release`)

    @contextlib.contextmanager
    def _locked(self):
        folder = os.path.dirname(self.path)
        if not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            self.made_folder = True
        while True:
            with open(self.lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:  # a release may remove the lock file (`_tidy`): a lock on a removed file locks nothing
                    current = os.stat(self.lock).st_ino == os.fstat(f.fileno()).st_ino
                except FileNotFoundError:
                    current = False
                if current:
                    yield
                    return
            os.makedirs(folder, exist_ok=True)

    def _raw(self) -> tuple[bytes | None, str | None]:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    def read(self) -> tuple[dict | None, str | None]:
        with self._locked():
            data, tag = self._raw()
        return (None, None) if data is None else (parse(data, self.uri), tag)

    def write(self, record: dict, tag: str | None) -> str | None:
        """Write `record` if the lease is absent (tag None) or still `tag`; the new tag, or None."""
        data = json.dumps(record).encode()
        with self._locked():
            if self._raw()[1] != tag:
                return None
            if tag is None:  # an atomic create: fails if the file exists
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                except FileExistsError:
                    return None
                with open(fd, "wb") as f:
                    f.write(data)
            else:
                tmp = os.path.join(os.path.dirname(self.path), f".lease.{uuid.uuid4().hex[:8]}")
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)
        return hashlib.sha256(data).hexdigest()

    def delete(self, tag: str) -> bool:
        with self._locked():
            if self._raw()[1] != tag:
                return False
            os.unlink(self.path)
            self._tidy()
            return True

    def _tidy(self) -> None:
        """Under the lock: a run folder this process made for its lease alone goes again with the lease (a run
        refused before it wrote anything leaves no `.lease.lock` behind); `_locked` re-checks the lock's inode."""
        folder = os.path.dirname(self.path)
        if self.made_folder and os.listdir(folder) == [".lease.lock"]:
            os.unlink(self.lock)
            with contextlib.suppress(OSError):
                os.rmdir(folder)


class _S3Lease:
    """Compare-and-swap through S3 conditional requests; the tag is the object's ETag."""

    LOST = ("412", "PreconditionFailed", "409", "ConditionalRequestConflict", "404", "NoSuchKey")

    def __init__(self, store, key: str):
        # the store's key (its error messages add the prefix) and the object's key in the bucket
        self.store, self.key, self.object_key, self.uri = store, key, store._key(key), store.uri(key)

    def _call(self, fn, **kw):
        from botocore.exceptions import ClientError

        try:
            with self.store._errors(self.key):
                return fn(Bucket=self.store.bucket, Key=self.object_key, **kw)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in self.LOST:
                return None
            raise

    def read(self) -> tuple[dict | None, str | None]:
        got = self._call(self.store.client.get_object)
        return (None, None) if got is None else (parse(got["Body"].read(), self.uri), got["ETag"])

    def write(self, record: dict, tag: str | None) -> str | None:
        cond = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        put = self._call(self.store.client.put_object, Body=json.dumps(record).encode(), **cond)
        return None if put is None else put["ETag"]

    def delete(self, tag: str) -> bool:
        return self._call(self.store.client.delete_object, IfMatch=tag) is not None


def expired(record: dict, now: float) -> bool:
    if now - float(record.get("heartbeat", 0)) > float(record.get("ttl_s", 0)):
        return True
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return True  # its holder died on this host
        except PermissionError:
            pass
    return False


def describe(record: dict) -> str:
    return (
        f"host {record.get('host')}, pid {record.get('pid')}, flow run {record.get('flow_run') or '-'}, "
        f"since {record.get('since')}"
    )


def verify(
    backend: _LocalLease | _S3Lease, run_name: str, ref: LeaseRef, bound: Callable[[dict], float] = lambda r: math.inf
) -> None:
    """LeaseLost unless the lease record is still `ref`'s (token and epoch) and its heartbeat younger than
    STALE * ttl (see the module doc); one read of the record. The heartbeat's age by the wall clock is capped by
    `bound(record)`, what the caller's monotonic clock knows of it: a step of a wall clock stops nothing."""
    current, _ = backend.read()
    stopped = "this run stopped without writing further"
    if current is None or current["token"] != ref.token or int(current["epoch"]) != ref.epoch:
        holder = (
            f"{describe(current)}, epoch {current['epoch']}"
            if current
            else "another run (its lease.json is gone: that run released it since, or it was deleted)"
        )
        raise LeaseLost(f"lineage {run_name}: lease lost to {holder}; {stopped}")
    age = min(time.time() - float(current["heartbeat"]), bound(current))
    if age > STALE * ref.ttl_s:
        raise LeaseLost(
            f"lineage {run_name}: lease lost to whichever run takes it over next (its heartbeat is {age:.0f} s "
            f"old, ttl {ref.ttl_s:g} s: the flow holding it stalled); {stopped}"
        )


class Fence:
    """The trainer's side of the lease (see the module doc): `check()` before a commit, `due_check()` at step
    boundaries (a read at most every ttl/6 s); both raise LeaseLost once the lease is not `ref`'s any more."""

    def __init__(self, run: Run, ref: LeaseRef):
        self.backend, self.run_name, self.ref = _backend(run), run.name, ref
        self.every_s, self.last = ref.ttl_s / 6, time.monotonic()
        self.seen: object = None  # the heartbeat of the last read, and when that read began
        self.read_at, self.renewed_after = -math.inf, -math.inf

    def check(self) -> None:
        began = time.monotonic()
        verify(self.backend, self.run_name, self.ref, lambda record: self._since_renewal(record, began))
        self.last = time.monotonic()

    def _since_renewal(self, record: dict, began: float) -> float:
        """At most this long ago, by this process's monotonic clock, was the heartbeat renewed: one that changed
        since the last read was written after that read began (unbounded until a change is seen)."""
        if record["heartbeat"] != self.seen:
            self.seen, self.renewed_after = record["heartbeat"], self.read_at
        self.read_at = began
        return time.monotonic() - self.renewed_after

    def due_check(self) -> None:
        if time.monotonic() - self.last < self.every_s:
            return
        try:
            self.check()
        except LeaseLost:
            raise
        except Exception as e:  # a store blip: the commit's fence still holds (under the upload retries)
            self.last = time.monotonic()  # look again in ttl/6 s, not at every step
            print(
                f"lineage {self.run_name}: the lease could not be read ({type(e).__name__}); trying again", flush=True
            )


@dataclass
class Lease:
    """A lease held by this process; `release()` gives it back (only if it is still ours). `on_lost` runs in
    the heartbeat thread when a renewal finds the lease taken over (the flow stops its job)."""

    backend: _LocalLease | _S3Lease
    uri: str
    run_name: str
    record: dict
    tag: str
    on_lost: Callable[[], object] | None = None
    lost: bool = False
    renewed_at: float = field(default_factory=time.monotonic)  # before the last renewal written, monotonic
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def ref(self) -> LeaseRef:
        return LeaseRef(token=self.record["token"], epoch=self.record["epoch"], ttl_s=self.record["ttl_s"])

    def check(self) -> None:
        """LeaseLost unless this process still holds the lease (before anything that must not happen twice)."""
        verify(self.backend, self.run_name, self.ref, lambda record: time.monotonic() - self.renewed_at)

    def _heartbeat(self) -> None:
        warned = False
        while not self._stop.wait(float(self.record["ttl_s"]) / 3):
            renewing = time.monotonic()
            try:
                tag = self.backend.write({**self.record, "heartbeat": time.time()}, self.tag)
            except Exception as e:
                if not warned:
                    print(f"lease {self.uri}: heartbeat failed ({type(e).__name__}); retrying", flush=True)
                    warned = True
                continue
            if tag is None:
                self.lost = True
                print(f"lease {self.uri}: lost (another run took it over after the heartbeat stalled)", flush=True)
                if self.on_lost is not None:
                    self.on_lost()
                return
            self.tag, self.renewed_at = tag, renewing

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost:
            return
        try:
            self.backend.delete(self.tag)
        except Exception as e:
            print(
                f"lease {self.uri}: could not be released ({type(e).__name__}); it expires "
                f"{self.record['ttl_s']:g} s after its last heartbeat",
                flush=True,
            )

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _backend(run: Run) -> _LocalLease | _S3Lease:
    store, key = run.store, run.layout.lease
    return _LocalLease(store, key) if isinstance(store, LocalStore) else _S3Lease(store, key)


def acquire(
    run: Run,
    holder: dict,
    ttl_s: float = 60.0,
    wait_s: float = 90.0,
    poll_s: float = 1.0,
    on_lost: Callable[[], object] | None = None,
) -> Lease:
    """Take the lease of lineage `run`, waiting up to `wait_s` for its holder to end (or its lease to expire); a
    UserError naming the holder when it does not. `holder` adds to host, pid and since."""
    backend, run_name = _backend(run), run.name
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **holder,
        "token": uuid.uuid4().hex,
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ttl_s": ttl_s,
    }
    deadline = time.monotonic() + wait_s
    while True:
        current, tag = backend.read()
        taking, now = time.monotonic(), time.time()
        tag = None if current is None else tag
        if current is None or expired(current, now):
            if current is not None:
                print(f"lineage {run_name}: taking over the expired lease of {describe(current)}", flush=True)
            mine = {**record, "epoch": int(current["epoch"]) + 1 if current else 1, "heartbeat": now}
            new = backend.write(mine, tag)
            if new is not None:
                lease = Lease(backend, backend.uri, run_name, mine, new, on_lost, renewed_at=taking)
                lease._thread = threading.Thread(target=lease._heartbeat, daemon=True, name="lineage-lease")
                lease._thread.start()
                return lease
            continue
        if time.monotonic() >= deadline:
            raise UserError(
                f"lineage {run_name!r} is in use by another run ({describe(current)}; lease "
                f"{backend.uri}): wait for it to end, or choose another run_name. A holder that "
                f"died gives it up {float(current['ttl_s']):g} s after its last heartbeat"
            )
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
