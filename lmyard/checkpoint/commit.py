"""The store side of a save, for both formats: upload the files, then commit the manifest, last.

    upload_files()   staged files -> their keys (a rename into a local store on the same filesystem)
    commit()         the manifest: from then on the checkpoint exists
    ensure_new()     a complete step is never written again (StepExists)

Design notes: docs/checkpoints.md, `lmyard/checkpoint/commit.py`.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from lmyard import faults
from lmyard.checkpoint.manifest import Manifest
from lmyard.errors import LeaseLost, StoreFull, StoreOutage
from lmyard.paths import free_space, no_space
from lmyard.retry import Backoff, retrying
from lmyard.run import Run
from lmyard.store import Store

T = TypeVar("T")
PARKED_WAKE_S = 30.0  # a parked checkpoint is tried again this often even if no save comes
DISCARD_WAIT_S = 30.0  # a discard waits this long for a staging write in flight (on a full disk it fails fast)


def upload_backoff(base_s: float = 1.0) -> Backoff:
    """The wait after each failed put of a round: base_s, 2 base_s, 4 base_s ... 32 base_s, at most 30 s."""
    return Backoff(base_s, cap_s=30.0, doublings=5)


class StepExists(RuntimeError):
    """A complete checkpoint of this step is already in the store: it is never overwritten."""


class Parked(StoreOutage):
    """A round of retries is spent: the checkpoint stays staged; the writer tries again later (see module doc)."""


class RetryPolicy:
    """`checkpoint.upload_retries` for every put of a checkpoint (see the module doc); one per writer."""

    def __init__(
        self,
        retries: int = 6,
        backoff_s: float = 1.0,
        say: Callable[[str], None] = print,
        store: Store | None = None,
        recovers: bool = False,
    ):
        self.retries, self.backoff_s, self.say = retries, backoff_s, say
        self.store, self.recovers = store, recovers  # for StoreFull: the folder, and what a rerun does
        self.failures = 0  # failed puts in a row, for the StoreOutage message
        self.last_error: BaseException | None = None  # the newest failed put's error
        self.wake = threading.Event()  # a save or flush: a parked checkpoint tries a new round now
        self.closing = threading.Event()  # no save will come: a spent round is final
        self.fence: Callable[[], None] | None = None  # LeaseLost once the lineage's lease is not ours (module doc)

    def delay(self, attempt: int) -> float:
        return self.backoff.delay(attempt)

    @property
    def backoff(self) -> Backoff:
        return upload_backoff(self.backoff_s)

    def run(self, step: int, staged: str, put: Callable[[], T]) -> T:
        """One round of `put()` (its result), else Parked: the caller keeps the checkpoint pending, calls
        `wait()`, and runs a new round; after close() a spent round is final."""

        def failed(e: Exception, attempt: int, delay: float | None) -> None:
            self.failures, self.last_error = self.failures + 1, e
            if delay is None:
                raise self._parked(step, staged, e) from e
            self.say(f"checkpoint step {step}: upload failed ({e}); retrying in {delay:.0f}s")

        result = retrying(put, self.backoff, self.retries + 1, fatal=(StepExists, LeaseLost), on_failure=failed)
        self.failures = 0
        return result

    def _parked(self, step: int, staged: str, error: Exception) -> Parked | StoreFull:
        if self.closing.is_set() and (full := self.store_full(f"checkpoint step {step}", staged)) is not None:
            return full
        if self.closing.is_set():
            return Parked(f"checkpoint step {step}: the store still fails ({error}); it stays staged in {staged}")
        self.say(
            f"checkpoint step {step}: upload failed {self.retries + 1} times ({error}); keeping it pending in "
            f"{staged}, trying again at the next save or in {PARKED_WAKE_S:.0f}s"
        )
        return Parked(f"checkpoint step {step} is parked in {staged}")

    def store_full(self, what: str, staged: str) -> StoreFull | None:
        """StoreFull when the newest failed put met a full disk (or quota) of a local store, else None."""
        local = self.store.local_path("") if self.store is not None else None
        full = no_space(self.last_error) if self.last_error is not None and local is not None else None
        if full is None or local is None:
            return None
        what_full = "quota exceeded" if str(full).startswith("quota") else "no space left"
        rerun = "uploads it first" if self.recovers else "resumes from the last committed checkpoint"
        return StoreFull(
            f"{what_full} in the store {local} ({free_space(local)}): {what} is kept staged in {staged}; free "
            f"space there, lower checkpoint.keep_last or point `store` at a bigger disk, then rerun: it {rerun}"
        )

    def wait(self) -> None:
        """A parked writer waits for the next save or flush (or PARKED_WAKE_S) before its next round."""
        self.wake.wait(PARKED_WAKE_S)
        self.wake.clear()


def outage(what: str, policy: RetryPolicy, staged: str) -> StoreOutage | StoreFull:
    """The StoreOutage the training loop gets (see the module doc); StoreFull when the store's disk is full."""
    if (full := policy.store_full(what, staged)) is not None:
        return full
    return StoreOutage(
        f"{what}; the store has failed {policy.failures} uploads in a row, and they are staged in "
        f"{staged}. Fix the store and rerun: the run resumes from the last committed checkpoint"
    )


def ensure_new(run: Run, step: int, files: dict | None = None) -> bool:
    """False when step `step` has no manifest yet; True when it has one listing exactly `files` (a retried commit
    whose manifest did land); else StepExists: a complete step is never written again."""
    store, layout = run.store, run.layout
    if not store.exists(layout.manifest(step)):
        return False
    if files is not None and Manifest.model_validate_json(store.read_bytes(layout.manifest(step))).files == files:
        return True
    raise StepExists(
        f"checkpoint {store.uri(layout.step(step))} already exists complete; it is not overwritten "
        "(another run of this lineage, or a step trained twice)"
    )


def put(store: Store, path: str, key: str) -> None:
    """Upload a staged file; into a local store on the same filesystem, a rename (no second copy on disk)."""
    target = store.local_path(key)
    if target is not None and not os.path.exists(path) and os.path.exists(target):
        return  # renamed into place by an earlier round
    if target is not None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(path, target)
            return
        except OSError:  # another filesystem: copy through the store instead
            pass
    store.upload(path, key)


def upload_files(store: Store, files: dict[str, str], step: int, policy: RetryPolicy, staged: str) -> float:
    """Put staged files (key -> local path) into the store, each under the retry policy; seconds it took."""
    t0 = time.perf_counter()
    faults.delay("slow_upload", step, "LMYARD_FAULT_SLOW_S", 30)
    for key, path in files.items():
        policy.run(step, staged, functools.partial(put, store, path, key))
    if faults.fires("crash_in_upload", step):
        print(f"injected crash while uploading checkpoint step {step}", flush=True)
        os._exit(1)
    return time.perf_counter() - t0


def commit(run: Run, manifest: Manifest, policy: RetryPolicy, staged: str) -> str:
    """Write the manifest of a checkpoint whose files are all in the store (the commit); returns its URI."""
    store, layout = run.store, run.layout
    manifest = manifest.model_copy(update={"committed": time.time()})

    def write() -> None:
        if policy.fence is not None:
            policy.fence()  # a stale holder's checkpoint never exists
        store.write_bytes(layout.manifest(manifest.step), manifest.to_bytes())

    policy.run(manifest.step, staged, write)
    return store.uri(layout.step(manifest.step))


def publish(run: Run, files: dict[str, str], manifest: Manifest, policy: RetryPolicy, staged: str) -> str:
    """The whole commit of staged files (name in the step folder -> local path): refused if the step is complete
    with other files, a no-op if with the same, else the files and then the manifest (with the upload's seconds)."""
    if policy.run(manifest.step, staged, lambda: ensure_new(run, manifest.step, manifest.files)):
        return run.uri(run.layout.step(manifest.step))
    keys = {run.layout.step_file(manifest.step, name): path for name, path in files.items()}
    upload_s = upload_files(run.store, keys, manifest.step, policy, staged)
    return commit(run, manifest.model_copy(update={"upload_s": round(upload_s, 3)}), policy, staged)
