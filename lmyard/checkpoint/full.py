"""The `full` format: rank 0 writes the whole state dicts (train.parallel=ddp).

    runs/<run>/checkpoints/step_NNNNNNNN/model.pt       model weights (state_dict)
                                         optim.pt       AdamW state
                                         rng.pt         RNG states of every rank
                                         state.json     step, tokens seen, data cursor, config, lineage
                                         manifest.json  lmyard.checkpoint.manifest.Manifest; written last

Design notes: docs/checkpoints.md, `lmyard/checkpoint/full.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import IO, cast

import torch

from lmyard.checkpoint.catalog import complete_steps
from lmyard.checkpoint.commit import DISCARD_WAIT_S, PARKED_WAKE_S, Parked, RetryPolicy, outage, publish
from lmyard.checkpoint.manifest import DamagedCheckpoint, FileMeta, Manifest, StreamHash, check_file, file_meta
from lmyard.checkpoint.pinned import pinned_empty
from lmyard.checkpoint.schema import CheckpointState
from lmyard.checkpoint.state import Checkpoint
from lmyard.errors import StoreFull, StoreOutage
from lmyard.paths import confined, no_space
from lmyard.run import Run

FILES = ("model.pt", "optim.pt", "rng.pt", "state.json")
STAGED = "staged.json"  # the manifest of a staged folder kept for the rerun (the store was full); never uploaded
EMPTY_OPTIM: dict[str, dict | list] = {"state": {}, "param_groups": []}


def stage(folder: str, model: dict, optim: dict, rng: list, state: dict) -> Manifest:
    """Serialize one checkpoint's files into a local folder; returns its manifest (not yet written). A full disk
    is NoSpace naming the folder (torch.save into a file object, so the OSError keeps its errno)."""
    t0 = time.perf_counter()
    try:
        os.makedirs(folder, exist_ok=True)
        trees = {"model.pt": model, "optim.pt": optim, "rng.pt": rng}
        # the files at once, each hashed by its writer: the optimizer's (2x the model's) sets the time
        with ThreadPoolExecutor(len(trees)) as pool:
            files = dict(pool.map(lambda item: _write(folder, *item), trees.items()))
        with open(os.path.join(folder, "state.json"), "w") as f:  # last, as before: the others are written
            json.dump(state, f, indent=1)
        files["state.json"] = file_meta(os.path.join(folder, "state.json"))
    except (OSError, RuntimeError) as e:
        full = no_space(e, os.path.dirname(folder), needed=sum(t.nbytes for t in _tensors([model, optim])))
        if full is None:
            raise
        shutil.rmtree(folder, ignore_errors=True)  # half a checkpoint is of no use: give its space back
        raise full from None
    return Manifest(
        format="full",
        step=state["step"],
        val_loss=state.get("val_loss"),
        world_size=state.get("world_size"),
        files={name: files[name] for name in FILES},
        serialize_s=round(time.perf_counter() - t0, 3),
    )


def _write(folder: str, name: str, tree) -> tuple[str, FileMeta]:
    """torch.save one tree into the folder; its name and size and sha256, hashed as it is written."""
    with open(os.path.join(folder, name), "wb") as f, ThreadPoolExecutor(2) as pool:
        out = _HashingFile(f, pool)
        torch.save(tree, cast(IO[bytes], out))  # torch.save needs only write and flush
    return name, out.hash.meta()


class _HashingFile:
    """What torch.save writes into: each large record (a tensor's bytes, one memoryview) is written, hashed whole
    and hashed by piece at once on three threads (file writes and hashlib release the GIL), so the whole-file
    sha256 costs no time after the write and the file is never read back (lmyard.checkpoint.manifest.StreamHash)."""

    AT_ONCE = 1 << 20  # smaller writes (the archive's headers, small tensors) stay on the caller's thread

    def __init__(self, f, pool: ThreadPoolExecutor):
        self.f, self.pool, self.hash = f, pool, StreamHash()

    def write(self, data) -> int:
        data = memoryview(data).cast("B")  # its length in bytes
        if len(data) < self.AT_ONCE:
            self.f.write(data)
            self.hash.update(data)
            self.hash.update_pieces(data)
            return len(data)
        written, pieces = self.pool.submit(self.f.write, data), self.pool.submit(self.hash.update_pieces, data)
        try:
            self.hash.update(data)
        finally:  # `data` is valid only during this call: nothing may still read it after the return
            wait([written, pieces])
        written.result(), pieces.result()  # a full disk: the write's OSError, errno kept
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def staged(folder: str) -> Manifest | None:
    """The manifest of a staged folder kept for the rerun (`FullCheckpointer.keep_for_rerun`), else None."""
    try:
        with open(os.path.join(folder, STAGED), "rb") as f:
            return Manifest.model_validate_json(f.read())
    except (OSError, ValueError):
        return None


class Snapshot:
    """A copy of a state tree off the GPU into reused pinned buffers, on a side stream.

    `take()` only enqueues the copies; `ready()` must be called before the source
    tensors change (the next optimizer update) and before the copy is read.
    """

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None
        self.stream: torch.cuda.Stream | None = None
        self.hurry = threading.Event()  # set at the first save: the buffers still to make are made without pauses

    def allocate(self, tree, path: str = "") -> None:
        """Create the pinned buffers for a tree's CUDA tensors ahead of the first copy (seconds for GBs)."""
        if isinstance(tree, torch.Tensor):
            if tree.is_cuda and path not in self.buffers:
                self.buffers[path] = pinned_empty(tree.shape, tree.dtype, self.hurry)
        elif isinstance(tree, dict):
            for k, v in tree.items():
                self.allocate(v, f"{path}/{k}")
        elif isinstance(tree, (list, tuple)):
            for i, v in enumerate(tree):
                self.allocate(v, f"{path}/{i}")

    def take(self, tree):
        cuda = any(t.is_cuda for t in _tensors(tree))
        if cuda and self.stream is None:
            self.stream = torch.cuda.Stream()
        if cuda:
            assert self.stream is not None, "made above on the first CUDA copy"
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                out = self._copy(tree, "")
                self.event = torch.cuda.Event()
                self.event.record(self.stream)
            return out
        return self._copy(tree, "")

    def _copy(self, tree, path: str):
        if isinstance(tree, torch.Tensor):
            if not tree.is_cuda:
                return tree.detach().clone()
            buf = self.buffers.get(path)
            if buf is None or buf.shape != tree.shape or buf.dtype != tree.dtype:
                buf = self.buffers[path] = pinned_empty(tree.shape, tree.dtype, self.hurry)
            buf.copy_(tree.detach(), non_blocking=True)
            return buf
        if isinstance(tree, dict):
            return {k: self._copy(v, f"{path}/{k}") for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._copy(v, f"{path}/{i}") for i, v in enumerate(tree))
        return tree

    def ready(self) -> None:
        """Make the current stream wait until the copy is done (no CPU wait)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait(self) -> None:
        """Block this thread until the copy is done."""
        if self.event is not None:
            self.event.synchronize()


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


class FullCheckpointer:
    """Saves whole checkpoints in the background from rank 0: snapshot now, serialize and commit later (see the
    module doc). Every rank makes one (the trainer's code is the same on every rank); only rank 0's writes."""

    sharded = False  # loads go into a plain (or DDP-wrapped) model, whole
    group = None  # resume agrees over the default process group

    def __init__(
        self,
        run: Run,
        staging_dir: str,
        *,
        rank: int = 0,
        max_pending: int = 2,
        retries: int = 6,
        backoff_s: float = 1.0,
        on_commit: Callable[[int, str], None] | None = None,
        say: Callable[[str], None] = print,
    ):
        self.run, self.store, self.writes = run, run.store, rank == 0
        self.staging = os.path.join(staging_dir, run.name)
        self.max_pending, self.policy = max_pending, RetryPolicy(retries, backoff_s, say, run.store, recovers=True)
        self.on_commit, self.say = on_commit or (lambda step, uri: None), say
        self.snapshot = Snapshot()
        self.cond = threading.Condition()
        self.copy_job: tuple | None = None  # (model, optim, rng, state) waiting to be serialized
        self.prepare_job: dict | None = None  # a state tree whose pinned buffers are to be made
        self.pending: list[tuple[str, Manifest]] = []  # staged (folder, manifest), oldest first
        self.closed = self.discarded = False
        self.error: BaseException | None = None
        self.blocked_s: list[float] = []
        self.threads = [
            threading.Thread(target=self._guarded, args=(loop,), daemon=True, name=name)
            for loop, name in (
                (self._serialize_loop, "checkpoint-serializer"),
                (self._upload_loop, "checkpoint-uploader"),
            )
        ]
        if self.writes:
            self.recover()
            for thread in self.threads:
                thread.start()

    def keep_for_rerun(self) -> None:
        """The store is full (StoreFull): give each pending folder its manifest, so the next writer uploads it."""
        with self.cond:
            kept = list(self.pending)
        for folder, manifest in kept:
            with contextlib.suppress(OSError):  # a cache disk too full for it: that rerun resumes from the store
                with open(os.path.join(folder, STAGED), "wb") as f:
                    f.write(manifest.to_bytes())

    def recover(self) -> None:
        """Queue the checkpoints an earlier writer of this run kept for the rerun (the store was full): those newer
        than the store's newest are uploaded first, oldest first; older ones are deleted. When the store cannot be
        listed, they stay for the next writer."""
        if not os.path.isdir(self.staging):
            return
        try:
            newest = max(complete_steps(self.run), default=-1)
        except Exception:
            return
        for name in sorted(os.listdir(self.staging)):
            folder = os.path.join(self.staging, name)
            manifest = staged(folder)
            if manifest is None:
                continue  # not kept for a rerun (a crash, a preemption): the rerun resumes from the store
            if manifest.step <= newest:
                shutil.rmtree(folder, ignore_errors=True)
                continue
            self.say(f"checkpoint step {manifest.step} was left staged in {folder}: uploading it")
            self.pending.append((folder, manifest))

    # -- the training loop's side
    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict, rng: list) -> float:
        """Snapshot the state (rank 0) and return; seconds the caller was blocked."""
        if not self.writes:
            return 0.0
        return self.save_state(model.state_dict(), optimizer.state_dict() if optimizer else EMPTY_OPTIM, state, rng)

    def save_state(self, model: dict, optim: dict, state: dict, rng: list) -> float:
        """`save` of state dicts already made."""
        t0 = time.perf_counter()
        self.snapshot.hurry.set()  # the buffers still being made (`prepare`) are waited for now: no more pauses
        with self.cond:
            self._raise_if_failed()
            if len(self.pending) >= self.max_pending:
                steps = [m.step for _, m in self.pending]
                error = outage(
                    f"{len(self.pending)} checkpoints (steps {steps}) are waiting for {self.store.root}",
                    self.policy,
                    self.staging,
                )
                if isinstance(error, StoreFull):
                    self.keep_for_rerun()
                raise error
            while self.prepare_job is not None and self.error is None:
                self.cond.wait()
            if self.copy_job is not None:
                self.say(
                    f"checkpoint step {state['step']} waits for step {self.copy_job[3]['step']} "
                    "to be serialized (the previous save is still copying)"
                )
                while self.copy_job is not None and self.error is None:
                    self.cond.wait()
                self._raise_if_failed()
            copy = self.snapshot.take({"model": model, "optim": optim})
            self.copy_job = (copy["model"], copy["optim"], rng, state)
            self.cond.notify_all()
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        return blocked

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Make the pinned copy buffers in the background, so the first save blocks no longer than later ones."""
        if not self.writes:
            return
        with self.cond:
            self.prepare_job = {"model": model.state_dict(), "optim": optimizer.state_dict() if optimizer else {}}
            self.cond.notify_all()

    def before_update(self) -> None:
        """Call before the optimizer changes the weights: orders the update after the copy."""
        self.snapshot.ready()

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every checkpoint so far is committed (or the writer failed); StoreOutage after
        `timeout_s` if the store still refuses them (they stay staged and keep being retried)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            self.cond.notify_all()  # a writer waiting out a failed upload retries now
            while (self.copy_job is not None or self.pending) and self.error is None:
                if deadline is not None and time.monotonic() >= deadline:
                    steps = [m.step for _, m in self.pending] + ([self.copy_job[3]["step"]] if self.copy_job else [])
                    raise outage(
                        f"checkpoints of steps {steps} are still not in {self.store.root} after {timeout_s:.0f} s",
                        self.policy,
                        self.staging,
                    )
                self.cond.wait(timeout=1)
        self._raise_if_failed()

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for every checkpoint to be committed (at exit); StoreOutage if the store still refuses one."""
        if not self.writes:
            return
        with self.cond:
            self.closed = True
            self.policy.closing.set()
            self.cond.notify_all()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._raise_if_failed()
        if self.pending:
            raise StoreOutage(
                f"{len(self.pending)} checkpoints could not be uploaded to {self.store.root}; "
                f"they are staged in {self.staging}"
            )

    def discard(self) -> None:
        """Stop without waiting and delete this run's staging folder (a full disk: its space goes back; what was
        not committed is lost, and a rerun resumes from the last committed checkpoint)."""
        with self.cond:
            self.closed = True
            self.policy.closing.set()
            self.copy_job, self.pending, self.discarded = None, [], True
            self.cond.notify_all()
        if self.writes:
            # a folder being staged now would outlive the delete (its makedirs after it): its writes end first
            serializer = self.threads[0]
            if serializer is not threading.current_thread():
                serializer.join(DISCARD_WAIT_S)
            shutil.rmtree(self.staging, ignore_errors=True)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # -- the background side: the serializer and the uploader, one thread each
    def _guarded(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as e:
            with self.cond:
                self.error = self.error or e
                self.cond.notify_all()

    def _serialize_loop(self) -> None:
        while True:
            with self.cond:
                while self.copy_job is None and self.prepare_job is None and not self.closed and self.error is None:
                    self.cond.wait()
                if self.error is not None:
                    return
                if self.prepare_job is not None:
                    self.snapshot.allocate(self.prepare_job)
                    self.prepare_job = None
                    self.cond.notify_all()
                    continue
                job = self.copy_job
                if job is None:  # closed, and nothing left to serialize
                    self.cond.notify_all()
                    return
            self._serialize(job)

    def _serialize(self, job: tuple) -> None:
        self.snapshot.wait()
        model, optim, rng, state = job
        folder = os.path.join(self.staging, f"step_{state['step']:08d}")
        manifest = stage(folder, model, optim, rng, state)
        with self.cond:
            self.copy_job = None
            if not self.discarded:
                self.pending.append((folder, manifest))
            self.cond.notify_all()

    def _upload_loop(self) -> None:
        """Commit staged checkpoints oldest first (step order), each under the retry policy; parked, the next
        save, a flush or PARKED_WAKE_S start a new round."""
        while True:
            with self.cond:
                while not self.pending and self.error is None and not (self.closed and self.copy_job is None):
                    self.cond.wait()
                if self.error is not None or not self.pending:
                    return
                folder, manifest = self.pending[0]
            files = {name: os.path.join(folder, name) for name in FILES}
            try:
                uri = publish(self.run, files, manifest, self.policy, folder)
            except StoreFull:
                self.keep_for_rerun()
                raise
            except Parked:
                if self.closed:
                    raise
                with self.cond:
                    self.cond.wait(timeout=PARKED_WAKE_S)
                continue
            shutil.rmtree(folder, ignore_errors=True)
            with self.cond:
                if self.pending and self.pending[0][0] == folder:
                    self.pending.pop(0)
                self.cond.notify_all()
            self.on_commit(manifest.step, uri)


def read_full(run: Run, manifest: Manifest, cache_dir: str) -> Checkpoint:
    """A `full` checkpoint, each file verified against its manifest. DamagedCheckpoint when its bytes are wrong;
    a read that fails (the store down, a network error) raises as it is: that is not damage."""
    store, layout, step = run.store, run.layout, manifest.step
    local = os.path.join(cache_dir, "checkpoint-load", str(os.getpid()), layout.step(step))  # ranks load at once

    def fetched(name: str) -> tuple[str, str]:
        key = layout.step_file(step, name)
        path = store.local_path(key)
        if path is None:
            path = confined(local, name, "checkpoint file")  # names come from the manifest in the store
            store.download(key, path)
        return name, check_file(manifest, name, path, store.uri(key))

    # the files at once: sha256 is one thread a file, and the optimizer's file (2x the model's) sets the time
    with ThreadPoolExecutor(max_workers=max(1, len(manifest.files))) as pool:
        paths = dict(pool.map(fetched, manifest.files))

    def load(name: str):
        try:  # mapped, not read again: the hash just read the file, and the copies to the model read the pages
            return torch.load(paths[name], map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, KeyError) as e:
            raise DamagedCheckpoint(f"{store.uri(layout.step_file(step, name))} does not load: {e}") from None

    try:
        with open(paths["state.json"]) as f:
            state = CheckpointState.model_validate_json(f.read())
    except (KeyError, ValueError) as e:  # pydantic's ValidationError: not a checkpoint state lmyard wrote
        raise DamagedCheckpoint(
            f"{store.uri(layout.step_file(step, 'state.json'))} is not a checkpoint state: {str(e).splitlines()[0]}"
        ) from None
    ckpt = Checkpoint(step, store.uri(layout.step(step)), load("model.pt"), load("optim.pt"), load("rng.pt"), state)
    if store.local_path(layout.step(step)) is None:
        shutil.rmtree(local, ignore_errors=True)
    return ckpt
