"""One writer per lineage: a lease on `runs/<run_name>/lease.json` in the store (`RunLayout.lease`).

A run takes the lease before it opens the lineage and gives it back at the end.
The lease names its holder (host, pid, flow run, since when) and carries a
heartbeat, renewed every ttl/3 by a background thread. A lease whose heartbeat
is older than its ttl (or whose holder is a dead process on this host) is
expired and may be taken over: a crashed holder does not block the lineage
for longer than the ttl. A second run waits up to `wait_s` for the lease,
then refuses with one line naming the holder.

Every change is a compare-and-swap, so two runs cannot both win:
- local store: the lease file is created with O_EXCL; renewals, takeovers and
  the release read and rewrite it under an exclusive flock of `.lease.lock`
  beside it (local filesystems; NFS v4 supports the same locks).
- S3: a conditional write (`If-None-Match: *` to create, `If-Match: <ETag>` to
  renew, take over or delete), which AWS S3 and the moto server used in the
  tests both honour. A server that ignores these headers gives only best
  effort: the last writer wins, and the loser finds out at its next heartbeat
  (its renewal no longer matches) and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from lmyard.errors import UserError
from lmyard.layout import RunLayout
from lmyard.store import LocalStore, Store


class _LocalLease:
    """Compare-and-swap on a lease file; the tag is the SHA-256 of its bytes."""

    def __init__(self, store: LocalStore, key: str):
        path = store.local_path(key)
        assert path is not None  # a local store maps every key to a file
        self.path: str = path
        self.lock = os.path.join(os.path.dirname(self.path), ".lease.lock")

    @contextlib.contextmanager
    def _locked(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _read(self) -> tuple[dict | None, str | None]:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, None
        return json.loads(data), hashlib.sha256(data).hexdigest()

    def read(self) -> tuple[dict | None, str | None]:
        with self._locked():
            return self._read()

    def write(self, record: dict, tag: str | None) -> str | None:
        """Write `record` if the lease is absent (tag None) or still `tag`; the new tag, or None."""
        data = json.dumps(record).encode()
        with self._locked():
            if self._read()[1] != tag:
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
            if self._read()[1] != tag:
                return False
            os.unlink(self.path)
            return True


class _S3Lease:
    """Compare-and-swap through S3 conditional requests; the tag is the object's ETag."""

    LOST = ("412", "PreconditionFailed", "409", "ConditionalRequestConflict", "404", "NoSuchKey")

    def __init__(self, store, key: str):
        self.store, self.key = store, store._key(key)

    def _call(self, fn, **kw):
        from botocore.exceptions import ClientError

        try:
            with self.store._errors(self.key):
                return fn(Bucket=self.store.bucket, Key=self.key, **kw)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in self.LOST:
                return None
            raise

    def read(self) -> tuple[dict | None, str | None]:
        got = self._call(self.store.client.get_object)
        return (None, None) if got is None else (json.loads(got["Body"].read()), got["ETag"])

    def write(self, record: dict, tag: str | None) -> str | None:
        cond = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        put = self._call(self.store.client.put_object, Body=json.dumps(record).encode(), **cond)
        return None if put is None else put["ETag"]

    def delete(self, tag: str) -> bool:
        return self._call(self.store.client.delete_object, IfMatch=tag) is not None


def _expired(record: dict, now: float) -> bool:
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


@dataclass
class Lease:
    """A lease held by this process; `release()` gives it back (only if it is still ours)."""

    backend: _LocalLease | _S3Lease
    uri: str
    record: dict
    tag: str
    lost: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _heartbeat(self) -> None:
        warned = False
        while not self._stop.wait(float(self.record["ttl_s"]) / 3):
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
                return
            self.tag = tag

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


def acquire(
    store: Store, run_name: str, holder: dict, ttl_s: float = 60.0, wait_s: float = 90.0, poll_s: float = 1.0
) -> Lease:
    """Take the lease of lineage `run_name`, waiting up to `wait_s` for its holder to end (or its lease to
    expire); a UserError naming the holder when it does not. `holder` adds to host, pid and since."""
    key = RunLayout(run_name).lease
    backend = _LocalLease(store, key) if isinstance(store, LocalStore) else _S3Lease(store, key)
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
        now = time.time()
        tag = None if current is None else tag
        if current is None or _expired(current, now):
            if current is not None:
                print(f"lineage {run_name}: taking over the expired lease of {describe(current)}", flush=True)
            new = backend.write({**record, "heartbeat": now}, tag)
            if new is not None:
                lease = Lease(backend, store.uri(key), record, new)
                lease._thread = threading.Thread(target=lease._heartbeat, daemon=True, name="lineage-lease")
                lease._thread.start()
                return lease
            continue
        if time.monotonic() >= deadline:
            raise UserError(
                f"lineage {run_name!r} is in use by another run ({describe(current)}; lease "
                f"{store.uri(key)}): wait for it to end, or choose another run_name. A holder that "
                f"died gives it up {float(current.get('ttl_s', ttl_s)):g} s after its last heartbeat"
            )
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
