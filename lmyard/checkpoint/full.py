"""Checkpoints in the store: a directory per step, files first, manifest last.

    runs/<run>/checkpoints/step_NNNNNNNN/model.pt       model weights (state_dict)
                                         optim.pt       AdamW state
                                         rng.pt         RNG states of every rank
                                         state.json     step, tokens seen, data cursor, config, lineage
                                         manifest.json  sizes + sha256 of the files above; written last

A checkpoint without its manifest does not exist. Tensors are loaded with
torch.load(weights_only=True): a checkpoint from a shared bucket cannot run code.

Saving is asynchronous (`AsyncCheckpointer`): the training loop is blocked only
while the state is copied off the GPU (on a side stream, overlapped with the
next forward and backward; the next optimizer update waits for the copy).
A background thread serializes the copy to a local staging folder and uploads
it, retrying with backoff. At most one copy is held in memory: if the next
checkpoint is due before the previous copy is serialized, the loop waits (and
says so). Serialized checkpoints waiting for the store are *pending*; while the
store is down training goes on until `checkpoint.max_pending` are pending, then
stops with an error that says where they are staged.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lmyard import faults
from lmyard.checkpoint.catalog import (
    complete_steps,
    read_manifest,
    step_prefix,
)
from lmyard.contracts import CheckpointState
from lmyard.data.shards import sha256_file
from lmyard.errors import StoreOutage
from lmyard.layout import MANIFEST, RunLayout
from lmyard.paths import confined
from lmyard.store import Store

log = logging.getLogger(__name__)
FILES = ("model.pt", "optim.pt", "rng.pt", "state.json")


class DamagedCheckpoint(ValueError):
    """A checkpoint's files do not match its manifest, or do not load: it is skipped, never repaired."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    uri: str
    model: dict
    optim: dict
    rng: list
    state: CheckpointState


# ---------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """This process's RNG states, as tensors and plain values (weights_only-loadable)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------- writing


def stage(folder: str, model: dict, optim: dict, rng: list, state: dict) -> dict:
    """Serialize one checkpoint's files into a local folder; returns its manifest (not yet written)."""
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    torch.save(model, os.path.join(folder, "model.pt"))
    torch.save(optim, os.path.join(folder, "optim.pt"))
    torch.save(rng, os.path.join(folder, "rng.pt"))
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump(state, f, indent=1)
    files = {
        name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": sha256_file(os.path.join(folder, name))}
        for name in FILES
    }
    return {
        "step": state["step"],
        "val_loss": state.get("val_loss"),
        "files": files,
        "serialize_s": round(time.perf_counter() - t0, 3),
    }


class StepExists(RuntimeError):
    """A complete checkpoint of this step is already in the store: it is never overwritten."""


def commit(store: Store, run_name: str, folder: str, manifest: dict) -> str:
    """Upload a staged checkpoint's files, then its manifest (with the upload's seconds); returns its URI.

    A step that already has a manifest is never written again: the same files (a retried commit
    whose manifest did land) are a no-op, other files raise StepExists.
    """
    prefix = step_prefix(run_name, manifest["step"])
    if store.exists(f"{prefix}/{MANIFEST}"):
        if json.loads(store.read_bytes(f"{prefix}/{MANIFEST}")).get("files") == manifest["files"]:
            return store.uri(prefix)
        raise StepExists(
            f"checkpoint {store.uri(prefix)} already exists complete; it is not overwritten "
            "(another run of this lineage, or a step trained twice)"
        )
    t0 = time.perf_counter()
    for name in FILES:
        staged, key = os.path.join(folder, name), f"{prefix}/{name}"
        target = store.local_path(key)
        if target is not None and _move(staged, target):
            pass  # a local store on the same filesystem: a rename, no second copy on disk
        else:
            store.upload(staged, key)
        if faults.fires("crash_in_upload", manifest["step"]):
            print(f"injected crash while uploading checkpoint step {manifest['step']}", flush=True)
            os._exit(1)
    manifest = {**manifest, "upload_s": round(time.perf_counter() - t0, 3), "committed": time.time()}
    store.write_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return store.uri(prefix)


def _move(src: str, dst: str) -> bool:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.replace(src, dst)
        return True
    except OSError:  # another filesystem: copy through the store instead
        return False


def save(
    store: Store, run_name: str, step: int, model: dict, optim: dict, rng: list, state: dict, staging_dir: str
) -> str:
    """Write one checkpoint synchronously (stage, then commit); returns its URI."""
    folder = os.path.join(staging_dir, run_name, f"step_{step:08d}")
    try:
        return commit(store, run_name, folder, stage(folder, model, optim, rng, {**state, "step": step}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Snapshot:
    """A copy of a state tree off the GPU into reused pinned buffers, on a side stream.

    `take()` only enqueues the copies; `ready()` must be called before the source
    tensors change (the next optimizer update) and before the copy is read.
    """

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None
        self.stream: torch.cuda.Stream | None = None

    def allocate(self, tree, path: str = "") -> None:
        """Create the pinned buffers for a tree's CUDA tensors ahead of the first copy (seconds for GBs)."""
        if isinstance(tree, torch.Tensor):
            if tree.is_cuda and path not in self.buffers:
                self.buffers[path] = torch.empty(tree.shape, dtype=tree.dtype, pin_memory=True)
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
                buf = self.buffers[path] = torch.empty(tree.shape, dtype=tree.dtype, pin_memory=True)
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


class AsyncCheckpointer:
    """Saves checkpoints in the background: snapshot now, serialize and upload later (see module doc)."""

    def __init__(
        self,
        store: Store,
        run_name: str,
        staging_dir: str,
        *,
        max_pending: int = 2,
        retries: int = 6,
        backoff_s: float = 1.0,
        on_commit: Callable[[int, str], None] | None = None,
        say: Callable[[str], None] = print,
    ):
        self.store, self.run_name = store, run_name
        self.staging = os.path.join(staging_dir, run_name)
        self.max_pending, self.retries, self.backoff_s = max_pending, retries, backoff_s
        self.on_commit, self.say = on_commit or (lambda step, uri: None), say
        self.snapshot = Snapshot()
        self.cond = threading.Condition()
        self.copy_job: tuple | None = None  # (model, optim, rng, state) waiting to be serialized
        self.prepare_job: dict | None = None  # a state tree whose pinned buffers are to be made
        self.pending: list[tuple[str, dict]] = []  # staged (folder, manifest), oldest first
        self.failures = 0
        self.closed = False
        self.error: BaseException | None = None
        self.blocked_s: list[float] = []
        self.thread = threading.Thread(target=self._work, daemon=True, name="checkpoint-writer")
        self.thread.start()

    # -- the training loop's side
    def save(self, model: dict, optim: dict, rng: list, state: dict) -> float:
        """Snapshot the state and return; seconds the caller was blocked."""
        t0 = time.perf_counter()
        with self.cond:
            self._raise_if_failed()
            if len(self.pending) >= self.max_pending:
                raise self._outage(
                    f"{len(self.pending)} checkpoints (steps {[m['step'] for _, m in self.pending]}) "
                    f"are waiting for {self.store.root}"
                )
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

    def prepare(self, model: dict, optim: dict) -> None:
        """Make the pinned copy buffers in the background, so the first save blocks no longer than later ones."""
        with self.cond:
            self.prepare_job = {"model": model, "optim": optim}
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
                    steps = [m["step"] for _, m in self.pending] + ([self.copy_job[3]["step"]] if self.copy_job else [])
                    raise self._outage(
                        f"checkpoints of steps {steps} are still not in {self.store.root} after {timeout_s:.0f} s"
                    )
                self.cond.wait(timeout=1)
        self._raise_if_failed()

    def _outage(self, what: str) -> StoreOutage:
        return StoreOutage(
            f"{what}; the store has failed {self.failures} uploads in a row, and they are staged in "
            f"{self.staging}. Fix the store and rerun: the run resumes from the last committed "
            "checkpoint"
        )

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for every checkpoint to be committed (at exit)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout_s)
        self._raise_if_failed()
        if self.pending:
            raise StoreOutage(
                f"{len(self.pending)} checkpoints could not be uploaded to {self.store.root}; "
                f"they are staged in {self.staging}"
            )

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # -- the background side
    def _work(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.copy_job is None and self.prepare_job is None and not self.pending and not self.closed:
                        self.cond.wait()
                    if self.prepare_job is not None:
                        self.snapshot.allocate(self.prepare_job)
                        self.prepare_job = None
                        self.cond.notify_all()
                        continue
                    job = self.copy_job
                    if job is None and not self.pending and self.closed:
                        return
                if job is not None:
                    self.snapshot.wait()
                    model, optim, rng, state = job
                    folder = os.path.join(self.staging, f"step_{state['step']:08d}")
                    manifest = stage(folder, model, optim, rng, state)
                    with self.cond:
                        self.copy_job = None
                        self.pending.append((folder, manifest))
                        self.cond.notify_all()
                self._upload_pending()
        except BaseException as e:
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _upload_pending(self) -> None:
        while True:
            with self.cond:
                if not self.pending:
                    return
                folder, manifest = self.pending[0]
            step = manifest["step"]
            for attempt in range(self.retries + 1):
                try:
                    uri = commit(self.store, self.run_name, folder, manifest)
                    break
                except StepExists:
                    raise
                except Exception as e:
                    self.failures += 1
                    if attempt == self.retries:
                        self.say(
                            f"checkpoint step {step}: upload failed {attempt + 1} times ({e}); keeping it "
                            f"pending in {folder}, {len(self.pending)} of {self.max_pending} allowed"
                        )
                        with self.cond:  # wait for the next save (or close) before trying again
                            if not self.closed:
                                self.cond.wait(timeout=30)
                            elif self.failures > 4 * (self.retries + 1):
                                raise
                        return
                    delay = min(30.0, self.backoff_s * 2**attempt)
                    self.say(f"checkpoint step {step}: upload failed ({e}); retrying in {delay:.0f}s")
                    time.sleep(delay)
            self.failures = 0
            shutil.rmtree(folder, ignore_errors=True)
            with self.cond:
                self.pending.pop(0)
                self.cond.notify_all()
            self.on_commit(step, uri)


# ---------------------------------------------------------------- reading


def load_step(store: Store, run_name: str, step: int, cache_dir: str) -> Checkpoint:
    """One checkpoint, verified against its manifest. DamagedCheckpoint when its bytes are wrong; a read
    that fails (the store down, a network error) raises as it is: that is not damage. A sharded checkpoint
    (lmyard.sharded_checkpoint) is read whole, as the same full state dicts."""
    import pickle

    layout = RunLayout(run_name)
    prefix = layout.step(step)
    manifest = read_manifest(store, run_name, step)
    if manifest.get("format") == "dcp":
        from lmyard.checkpoint.dcp import load_full

        return load_full(store, run_name, step, cache_dir)
    local = os.path.join(cache_dir, "checkpoint-load", str(os.getpid()), prefix)  # one per process: ranks load at once
    paths = {}
    for name, meta in manifest["files"].items():
        key = layout.step_file(step, name)
        path = store.local_path(key)
        if path is None:
            path = confined(local, name, "checkpoint file")  # names come from the manifest in the store
            store.download(key, path)
        if not os.path.exists(path) or sha256_file(path) != meta["sha256"]:
            raise DamagedCheckpoint(f"{store.uri(key)} does not match its manifest checksum")
        paths[name] = path

    def load(name: str):
        try:
            return torch.load(paths[name], map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
            raise DamagedCheckpoint(f"{store.uri(layout.step_file(step, name))} does not load: {e}") from None

    with open(paths["state.json"]) as f:
        try:
            state = CheckpointState.model_validate_json(f.read())
        except ValueError as e:  # pydantic's ValidationError: not a checkpoint state lmyard wrote
            raise DamagedCheckpoint(
                f"{store.uri(layout.step_file(step, 'state.json'))} is not a checkpoint state: {str(e).splitlines()[0]}"
            ) from None
    ckpt = Checkpoint(
        step=step,
        uri=store.uri(prefix),
        model=load("model.pt"),
        optim=load("optim.pt"),
        rng=load("rng.pt"),
        state=state,
    )
    if store.local_path(prefix) is None:
        shutil.rmtree(local, ignore_errors=True)
    return ckpt


def find_latest(
    store: Store,
    run_name: str,
    cache_dir: str,
    read_attempts: int = 3,
    backoff_s: float = 2.0,
    loader: Callable[[int], object] | None = None,
    steps: list[int] | None = None,
) -> tuple[Checkpoint | None, list[int]]:
    """(the newest checkpoint whose files match its manifest, the damaged steps skipped on the way).

    A damaged checkpoint is skipped with a warning naming it; a read error is retried `read_attempts`
    times and then raised: a store hiccup never makes a good checkpoint look damaged. `loader(step)`
    loads one (default: `load_step`); `steps`: the complete steps to try (default: `complete_steps`).
    """
    loader = loader or (lambda step: load_step(store, run_name, step, cache_dir))
    damaged: list[int] = []
    for step in reversed(complete_steps(store, run_name) if steps is None else steps):
        for attempt in range(read_attempts):
            try:
                return loader(step), damaged
            except DamagedCheckpoint as e:
                msg = (
                    f"warning: checkpoint {store.uri(step_prefix(run_name, step))} is damaged "
                    f"({str(e).splitlines()[0]}); falling back to the previous one"
                )
                log.warning(msg)
                print(msg, flush=True)
                damaged.append(step)
                break
            except Exception as e:
                if attempt == read_attempts - 1:
                    raise
                print(
                    f"reading checkpoint step {step} failed ({type(e).__name__}: {str(e)[:200]}); retrying", flush=True
                )
                time.sleep(backoff_s * 2**attempt)
    return None, damaged


def load_latest(store: Store, run_name: str, cache_dir: str) -> Checkpoint | None:
    """The newest checkpoint whose files match its manifest; damaged ones are skipped with a warning."""
    return find_latest(store, run_name, cache_dir)[0]
