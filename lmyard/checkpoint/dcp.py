"""Sharded checkpoints: every rank writes its own shards with torch.distributed.checkpoint (DCP).

    runs/<run>/checkpoints/step_NNNNNNNN/dcp/.metadata        DCP's index of every tensor chunk (rank 0)
                                         dcp/__R_0.distcp     rank R's shards of model + optimizer
                                         ranks/rank_RRRRR.json  rank R's files, sizes + sha256: "uploaded"
                                         rng.pt               RNG states of every rank (rank 0)
                                         state.json           step, data cursor, config, ... (rank 0)
                                         manifest.json        "format": "dcp", sizes + sha256 of every
                                                              file above but the markers; written last

The layout, the manifest-last rule and the checksums are those of `lmyard.checkpoint`,
so `checkpoint.complete_steps`, the fallback of `checkpoint.load_latest` and
`retention` treat a sharded checkpoint like any other.

Saving (`ShardedCheckpointer.save`, called by every rank): the loop is blocked
while DCP stages this rank's shards into reused CPU buffers (pinned on GPUs; with
`async_staging` the copy runs on a side stream and only `before_update()` waits
for it). DCP then writes them to a node-local folder in its own thread (its
collectives use a gloo group of their own), and this rank's upload thread puts its
files into the store and writes its marker object `ranks/rank_RRRRR.json`
(while the store fails it retries and the loop goes on, until `max_pending`
checkpoints wait: then save() raises StoreOutage, as AsyncCheckpointer does). Rank 0 waits until every rank's marker exists, then
writes rng.pt, state.json and the manifest. Markers rather than a collective: the
ranks of different nodes share no filesystem and rank 0 needs every file's
checksum; a marker carries them, a slow or failed upload of one rank never stalls
a collective in the other ranks, and rank 0 gives up after `commit_timeout_s`
leaving the step without a manifest (invisible).

Loading (`load_sharded`) reshards to any world size (DCP plans the reads from
the target's DTensor placements) and checks the sha256 of each file before DCP
reads it; a damaged or missing file raises DamagedCheckpoint naming it, so
`find_latest_sharded` (checkpoint.find_latest for either format, on every rank
together) falls back to the previous checkpoint. `load_full` reads a
sharded checkpoint on one process, without a process group, into today's full
state dicts (`checkpoint.Checkpoint`: model by name, optimizer by parameter
index), which is what `checkpoint.load_step` returns for either format.
Non-tensor values and DCP's metadata are unpickled with restricted loaders: a
checkpoint from a shared bucket cannot run code.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lmyard import faults
from lmyard.checkpoint import full as checkpoint
from lmyard.checkpoint.full import MANIFEST, Checkpoint, DamagedCheckpoint, StepExists, step_prefix
from lmyard.contracts import CheckpointState
from lmyard.data.shards import sha256_file
from lmyard.errors import StoreOutage, UserError
from lmyard.paths import confined
from lmyard.store import Store

FORMAT = "dcp"
DCP_DIR = "dcp"
RANKS_DIR = "ranks"


def is_sharded(manifest: dict) -> bool:
    return manifest.get("format") == FORMAT


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world(group=None) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if _distributed() else (0, 1)


def _agree(value, group=None):
    """Rank 0's value (rank 0 of `group`; default: of the world), on every rank."""
    if not _distributed() or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]


def _gather(value, group=None) -> list:
    """Every rank's value, on every rank."""
    if not _distributed():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def marker_key(run_name: str, step: int, rank: int) -> str:
    return f"{step_prefix(run_name, step)}/{RANKS_DIR}/rank_{rank:05d}.json"


def _file_meta(path: str) -> dict:
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}


# ---------------------------------------------------------------- writing


@dataclass
class _Job:
    step: int
    folder: str  # this rank's staging folder
    future: object  # DCP's write future
    state: dict
    rng: list | None
    t0: float = 0.0  # when save() was called


def _torch_at_least(major: int, minor: int) -> bool:
    found = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return found >= (major, minor)


class _CopyTable(dict):
    """A stager's copy table that always knows `type` (a class is copied as itself, as `copy` does), even after
    the stager clears its table."""

    def __missing__(self, key):
        if key is type:
            import copy

            return copy._deepcopy_atomic
        raise KeyError(key)


def _stager_copying_classes(stager: DefaultStager) -> DefaultStager:
    """DCP's stager deep-copies a DTensor's spec, which refers to classes; torch before 2.12 lacks `type` in the
    stager's copy table and fails with KeyError: <class 'type'>. Every StateDictStager (DCP makes them inside
    DefaultStager, at once or on first use) gets a table that knows it."""
    from torch.distributed.checkpoint import _state_dict_stager

    cls = _state_dict_stager.StateDictStager
    if not getattr(cls, "_lmyard_copies_classes", False):
        original = cls.__init__

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self._deepcopy_dispatch = _CopyTable(self._deepcopy_dispatch)

        cls.__init__, cls._lmyard_copies_classes = init, True
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None and not isinstance(getattr(inner, "_deepcopy_dispatch", None), _CopyTable):
        inner._deepcopy_dispatch = _CopyTable(inner._deepcopy_dispatch)
    return stager


class ShardedCheckpointer:
    """Saves sharded checkpoints in the background; every rank makes one (see the module doc).

    Construct it on every rank at the same point (it makes a gloo process group, a collective).
    """

    def __init__(
        self,
        store: Store,
        run_name: str,
        staging_dir: str,
        *,
        async_staging: bool | None = None,
        write_threads: int = 1,
        max_pending: int = 2,
        retries: int = 6,
        backoff_s: float = 1.0,
        commit_timeout_s: float = 1800.0,
        on_commit: Callable[[int, str], None] | None = None,
        say: Callable[[str], None] = print,
        process_group=None,
    ):
        self.store, self.run_name = store, run_name
        self.retries, self.backoff_s, self.commit_timeout_s = retries, backoff_s, commit_timeout_s
        self.max_pending = max_pending
        self.stopping = threading.Event()  # set by close(): the upload thread stops retrying
        self.on_commit, self.say = on_commit or (lambda step, uri: None), say
        distributed = _distributed()
        self.owns_group = process_group is None and distributed
        self.group = dist.new_group(backend="gloo") if self.owns_group else process_group
        self.rank, self.world = _rank_world(self.group)
        self.attempt = _agree(uuid.uuid4().hex, self.group)  # markers of an earlier attempt at a step don't count
        self.staging = os.path.join(staging_dir, run_name)
        self.write_threads = write_threads  # DCP's writer threads, one file each per rank
        cuda = torch.cuda.is_available()
        self.async_staging = cuda if async_staging is None else async_staging and cuda
        # torch >= 2.12: DCP's stager (reused pinned buffers, optionally on a side stream). Before, its stager
        # cannot copy a DTensor's spec (KeyError: <class 'type'>, then unbounded recursion): the writer stages
        # instead, a blocking copy into pinned buffers it keeps (cache_staged_state_dict) between saves.
        self.stager, self.writer = None, None
        if _torch_at_least(2, 12):
            self.stager = _stager_copying_classes(
                DefaultStager(
                    StagingOptions(
                        use_pinned_memory=cuda,
                        use_shared_memory=False,
                        use_async_staging=self.async_staging,
                        use_non_blocking_copy=cuda,
                    )
                )
            )
        else:
            self.async_staging = False
            self.writer = dcp.FileSystemWriter(self.staging, thread_count=write_threads, cache_staged_state_dict=cuda)
        self.writing = None  # DCP future of the newest save: its staged buffers are reused by the next
        self.staged = None  # future of the newest save's staging (async_staging only)
        self.prepared: Future | None = None  # the background making of the staging buffers (prepare)
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.unfinished: list[int] = []  # steps saved but not yet uploaded (on rank 0: committed)
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.blocked_s: list[float] = []
        self.timings: list[dict] = []  # per save: seconds from save() until written, uploaded, committed (rank 0)
        self.thread = threading.Thread(target=self._work, daemon=True, name="sharded-checkpoint-uploader")
        self.thread.start()

    # -- the training loop's side
    def save(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict, rng: list | None = None
    ) -> float:
        """Stage this rank's shards and return; seconds the caller was blocked.

        `state` (a JSON-able dict with "step") and `rng` (every rank's RNG states) are written by rank 0.
        """
        t0 = time.perf_counter()
        self._raise_if_failed()
        step = int(state["step"])
        if len(self.unfinished) >= self.max_pending:
            raise StoreOutage(
                f"{len(self.unfinished)} checkpoints (steps {self.unfinished}) are waiting for "
                f"{self.store.root}; this rank's files are staged in {self.staging}. Fix the store and "
                "rerun: the run resumes from the last committed checkpoint"
            )
        if self.prepared is not None:
            if not self.prepared.done():
                self.say(f"checkpoint step {step} waits for its staging buffers to be made")
            self.prepared.result()
            self.prepared = None
        if self.writing is not None and not self.writing.done():
            self.say(f"checkpoint step {step} waits for the previous one to be written to the staging folder")
        if self.writing is not None:
            self.writing.result()  # the staging buffers are reused: the previous write must have read them
        folder = os.path.join(self.staging, f"step_{step:08d}", f"rank_{self.rank:05d}")
        shutil.rmtree(folder, ignore_errors=True)
        if self.async_staging:
            torch.cuda.current_stream().synchronize()  # the side-stream copy must see the last update
        if self.stager is None:
            out = dcp.async_save(
                state_dict(model, optimizer), checkpoint_id=folder, storage_writer=self.writer, process_group=self.group
            )
        else:
            writer = dcp.FileSystemWriter(folder, thread_count=self.write_threads)
            out = dcp.async_save(
                state_dict(model, optimizer), storage_writer=writer, process_group=self.group, async_stager=self.stager
            )
        self.writing = getattr(out, "upload_completion", out)
        self.staged = getattr(out, "staging_completion", None)
        with self.cond:
            self.unfinished.append(step)
        self.jobs.put(_Job(step, folder, self.writing, dict(state), rng, t0))
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        return blocked

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Make the staging buffers (pinned host memory: seconds for GBs) in the background, so the first save
        blocks no longer than later ones. Call once the optimizer has its state (after the first step)."""
        if self.stager is None:  # the writer makes its buffers at the first save
            return
        sd = state_dict(model, optimizer)
        self.prepared = Future()
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def make() -> None:
            try:
                if device is not None:  # a new thread starts on GPU 0: a context there would cost memory
                    torch.cuda.set_device(device)
                staged = self.stager.stage(sd)  # a throwaway copy: it only fills the stager's buffer cache
                if isinstance(staged, Future):
                    staged.result()
                self.prepared.set_result(None)
            except BaseException as e:
                self.prepared.set_exception(e)

        threading.Thread(target=make, daemon=True, name="sharded-checkpoint-prepare").start()

    def before_update(self) -> float:
        """Call before the optimizer changes the weights; waits for an asynchronous staging copy (seconds)."""
        if self.staged is None:
            return 0.0
        t0 = time.perf_counter()
        self.staged.result()
        self.staged = None
        waited = time.perf_counter() - t0
        if self.blocked_s:
            self.blocked_s[-1] += waited
        return waited

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every checkpoint so far is uploaded (and, on rank 0, committed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while self.unfinished and self.error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise StoreOutage(
                        f"checkpoints of steps {self.unfinished} are still not in {self.store.root} "
                        f"after {timeout_s:.0f} s; this rank's files are staged in {self.staging}"
                    )
                self.cond.wait(timeout=1 if left is None else min(1, left))
        self._raise_if_failed()

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for every checkpoint, then stop the upload thread and free the staging buffers."""
        try:
            self.flush(timeout_s)
        finally:
            self.stopping.set()
            self.jobs.put(None)
            self.thread.join(5)
            if self.stager is not None:
                self.stager.close()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # -- the background side
    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                if self.error is None:
                    self._finish(job)
            except BaseException as e:
                self.error = e
            with self.cond:
                self.unfinished.remove(job.step)
                self.cond.notify_all()

    def _finish(self, job: _Job) -> None:
        job.future.result()  # DCP wrote this rank's files (raises if any rank failed)
        times = {"step": job.step, "written_s": time.perf_counter() - job.t0}
        prefix = step_prefix(self.run_name, job.step)
        if self.store.exists(f"{prefix}/{MANIFEST}"):  # its files are never overwritten (as checkpoint.commit)
            raise StepExists(
                f"checkpoint {self.store.uri(prefix)} already exists complete; it is not overwritten "
                "(another run of this lineage, or a step trained twice)"
            )
        files = {}
        for name in sorted(os.listdir(job.folder)):
            path = os.path.join(job.folder, name)
            files[f"{DCP_DIR}/{name}"] = _file_meta(path)
            self._retry(job.step, lambda p=path, k=f"{prefix}/{DCP_DIR}/{name}": _put(self.store, p, k))
        if faults.fires("crash_in_upload", job.step):
            print(f"injected crash while uploading checkpoint step {job.step} (rank {self.rank})", flush=True)
            os._exit(1)
        body = json.dumps({"rank": self.rank, "attempt": self.attempt, "files": files}).encode()
        self._retry(job.step, lambda: self.store.write_bytes(marker_key(self.run_name, job.step, self.rank), body))
        shutil.rmtree(job.folder, ignore_errors=True)
        times.update(uploaded_s=time.perf_counter() - job.t0, bytes=sum(m["bytes"] for m in files.values()))
        if self.rank == 0:
            uri = self._commit(job, prefix)
            times["committed_s"] = time.perf_counter() - job.t0
            shutil.rmtree(f"{job.folder}-commit", ignore_errors=True)
        with contextlib.suppress(OSError):  # the step's folder, once the node's last rank is done with it
            os.rmdir(os.path.dirname(job.folder))
        self.timings.append(times)
        if self.rank == 0:
            self.on_commit(job.step, uri)

    def _commit(self, job: _Job, prefix: str) -> str:
        """Rank 0: once every rank's marker is in the store, write rng.pt, state.json, then the manifest."""
        files = {}
        for marker in self._wait_for_markers(job.step):
            files.update(marker["files"])
        folder = f"{job.folder}-commit"
        os.makedirs(folder, exist_ok=True)
        extra = {
            "rng.pt": lambda p: torch.save(job.rng or [], p),
            "state.json": lambda p: Path(p).write_text(json.dumps(job.state, indent=1)),
        }
        for name, write in extra.items():
            path = os.path.join(folder, name)
            write(path)
            files[name] = _file_meta(path)
            self._retry(job.step, lambda p=path, k=f"{prefix}/{name}": _put(self.store, p, k))
        manifest = {
            "format": FORMAT,
            "step": job.step,
            "val_loss": job.state.get("val_loss"),
            "world_size": self.world,
            "files": files,
            "committed": time.time(),
        }
        self._retry(
            job.step, lambda: self.store.write_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        )
        return self.store.uri(prefix)

    def _wait_for_markers(self, step: int) -> list[dict]:
        """Every rank's marker (one listing per poll: a few requests, whatever the world size)."""
        deadline, found = time.monotonic() + self.commit_timeout_s, {}
        ranks = f"{step_prefix(self.run_name, step)}/{RANKS_DIR}"
        while len(found) < self.world:
            with contextlib.suppress(Exception):  # the store failing now is like a marker not there yet
                for key in self.store.list(ranks):
                    rank = int(key.rsplit("_", 1)[-1].removesuffix(".json"))
                    if rank not in found and rank < self.world:
                        marker = json.loads(self.store.read_bytes(key))
                        if marker.get("attempt") == self.attempt:
                            found[rank] = marker
            if len(found) < self.world:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world)) - set(found))
                    raise StoreOutage(
                        f"checkpoint step {step}: ranks {missing} did not upload their shards within "
                        f"{self.commit_timeout_s:.0f} s; the step stays uncommitted"
                    )
                time.sleep(0.5)
        return [found[r] for r in range(self.world)]

    def _retry(self, step: int, put: Callable[[], None]) -> None:
        """Run `put` until it succeeds: `retries` times with backoff, then every 30 s (the checkpoint stays
        pending; save() stops the loop once `max_pending` are). A UserError (access denied, no bucket) is final."""
        attempt = 0
        while True:
            try:
                return put()
            except UserError:
                raise
            except Exception as e:
                attempt += 1
                delay = min(30.0, self.backoff_s * 2 ** min(attempt - 1, 5))
                if attempt <= self.retries:
                    self.say(f"checkpoint step {step}: upload failed ({e}); retrying in {delay:.0f}s")
                elif attempt == self.retries + 1:
                    self.say(
                        f"checkpoint step {step}: upload failed {attempt} times ({e}); keeping it pending in "
                        f"{self.staging}, retrying every {delay:.0f}s"
                    )
                if self.stopping.wait(delay):
                    raise StoreOutage(
                        f"checkpoint step {step}: the store {self.store.root} still fails ({e}); "
                        f"this rank's files stay staged in {self.staging}"
                    ) from e


def _put(store: Store, path: str, key: str) -> None:
    """Upload a staged file; into a local store on the same filesystem, a rename (no second copy)."""
    target = store.local_path(key)
    if target is None or not checkpoint._move(path, target):
        store.upload(path, key)


def state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """{"model": ..., "optim": ...}: this rank's shards (DTensors under FSDP2), keyed by parameter name."""
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(
    store: Store, run_name: str, model, optimizer, state: dict, staging_dir: str, rng: list | None = None, **kwargs
) -> str:
    """Write one sharded checkpoint and wait until it is committed (every rank calls it); its URI."""
    ckpt = ShardedCheckpointer(store, run_name, staging_dir, say=lambda s: None, **kwargs)
    try:
        ckpt.save(model, optimizer, state, rng)
        ckpt.flush()
    finally:
        ckpt.close()
    if ckpt.group is not None and ckpt.world > 1:
        dist.barrier(group=ckpt.group)  # every rank returns once rank 0 has committed
    if ckpt.owns_group:
        dist.destroy_process_group(ckpt.group)
    return store.uri(step_prefix(run_name, int(state["step"])))


# ---------------------------------------------------------------- reading


class _SafeUnpickler(pickle.Unpickler):
    """DCP's .metadata holds dataclasses of torch.distributed.checkpoint.metadata, torch dtypes, sizes and
    layouts, paths and builtins: nothing else is resolved (a function named there could run anything)."""

    NAMES = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.NAMES:
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata":
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint may not hold")


def _safe_bytes(value: io.BytesIO) -> io.BytesIO:
    """Non-tensor values (optimizer hyperparameters, ...) through torch.load(weights_only=True), re-serialized."""
    out = io.BytesIO()
    torch.save(torch.load(value, weights_only=True), out)
    out.seek(0)
    return out


class _SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        super().load_bytes(read_item, _safe_bytes(value))


class _SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    def load_bytes(self, read_item, value):
        super().load_bytes(read_item, _safe_bytes(value))


class _VerifiedReader(dcp.FileSystemReader):
    """Reads a checkpoint's dcp/ files, each fetched from the store (unless local) and checked against the
    manifest before its first read; a missing or damaged file raises DamagedCheckpoint naming it."""

    def __init__(self, store: Store, prefix: str, manifest: dict, local_dir: str):
        in_place = store.local_path(f"{prefix}/{DCP_DIR}")
        super().__init__(in_place or local_dir)
        self.store, self.prefix, self.files, self.in_place = store, prefix, manifest["files"], in_place is not None
        self.checked: set[str] = set()
        self.metadata = None

    def _check(self, name: str) -> str:
        key = f"{self.prefix}/{DCP_DIR}/{name}"
        path = confined(str(self.path), name, "checkpoint file")  # names come from files in the store
        if name in self.checked:
            return path
        meta = self.files.get(f"{DCP_DIR}/{name}")
        if meta is None:
            raise DamagedCheckpoint(f"{self.store.uri(key)} is not in the checkpoint's manifest")
        if not self.in_place:
            self.store.download(key, path)  # a failed read is not damage: raised as it is, then retried
        if not os.path.exists(path) or sha256_file(path) != meta["sha256"]:
            raise DamagedCheckpoint(f"{self.store.uri(key)} does not match its manifest checksum")
        self.checked.add(name)
        return path

    def load_metadata(self):
        """DCP's index, checked and unpickled safely; called before dcp.load, whose own wrapping of a failed
        read would hide that the checkpoint is damaged."""
        if self.metadata is None:
            with open(self._check(".metadata"), "rb") as f:
                try:
                    self.metadata = _SafeUnpickler(f).load()
                except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
                    raise DamagedCheckpoint(
                        f"{self.store.uri(f'{self.prefix}/{DCP_DIR}/.metadata')} does not load: {e}"
                    ) from None
            if getattr(self.metadata, "storage_meta", None) is not None:
                self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_metadata(self, *args, **kwargs):
        return self.load_metadata()

    def read_data(self, plan, planner):
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self._check(name)
        return super().read_data(plan, planner)


def _fetch(store: Store, prefix: str, manifest: dict, name: str, local_dir: str) -> str:
    """A checkpoint file checked against the manifest: its local path (downloaded unless the store is local)."""
    key = f"{prefix}/{name}"
    path = store.local_path(key)
    if path is None:
        path = os.path.join(local_dir, name)
        store.download(key, path)  # a failed read is not damage: raised as it is
    meta = manifest["files"].get(name)
    if meta is None or not os.path.exists(path) or sha256_file(path) != meta["sha256"]:
        raise DamagedCheckpoint(f"{store.uri(key)} does not match its manifest checksum")
    return path


def _unwrap(e: BaseException) -> Exception:
    """DCP's CheckpointException (a BaseException carrying every rank's failure) as one error: the first
    DamagedCheckpoint of any rank (so every rank skips the checkpoint), else the first rank's error."""
    failures = [f[0] for f in (getattr(e, "failures", None) or {}).values()]
    damaged = [f for f in failures if isinstance(f, DamagedCheckpoint)]
    if damaged or failures:
        first = (damaged or failures)[0]
        return first if isinstance(first, Exception) else RuntimeError(str(first))
    return e if isinstance(e, Exception) else RuntimeError(str(e))


def _read_sharded(
    store: Store,
    run_name: str,
    step: int,
    state: dict,
    cache_dir: str,
    planner,
    process_group=None,
    no_dist: bool = False,
) -> tuple[dict, dict]:
    """Fill `state` (a state dict, empty with _SafeEmptyPlanner) from checkpoint `step`; (manifest, extras)."""
    prefix = step_prefix(run_name, step)
    manifest = checkpoint.read_manifest(store, run_name, step)
    if not is_sharded(manifest):
        raise DamagedCheckpoint(
            f"{store.uri(prefix)} is not a sharded checkpoint (format {manifest.get('format', 'full')})"
        )
    local = os.path.join(cache_dir, "checkpoint-load", str(os.getpid()), prefix)
    try:
        reader = _VerifiedReader(store, prefix, manifest, os.path.join(local, DCP_DIR))
        reader.load_metadata()
        try:
            if state:
                dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
            else:  # dcp.load fills only the keys it is given; this fills an empty dict (_load_state_dict_from_keys)
                _load_state_dict(state_dict=state, storage_reader=reader, planner=planner, no_dist=True)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _unwrap(e) from None
        with open(_fetch(store, prefix, manifest, "state.json", local)) as f:
            extras = {
                "state": CheckpointState.model_validate_json(f.read()),
                "rng": torch.load(_fetch(store, prefix, manifest, "rng.pt", local), weights_only=True),
            }
    finally:
        if store.local_path(prefix) is None:
            shutil.rmtree(local, ignore_errors=True)
    return manifest, extras


@dataclass(frozen=True)
class Loaded:
    """What a load put into the model and optimizer came from: the step, its URI, RNG states and state.json."""

    step: int
    uri: str
    rng: list
    state: CheckpointState


def load_sharded(
    store: Store,
    run_name: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cache_dir: str,
    process_group=None,
) -> Loaded:
    """Load sharded checkpoint `step` into `model` (FSDP2-wrapped or plain) and `optimizer`, on any world size.

    Every rank calls it. A missing or damaged file raises DamagedCheckpoint (on every rank) naming it; a read
    that fails (the store down) raises as it is.
    """
    target = state_dict(model, optimizer)
    _, extras = _read_sharded(store, run_name, step, target, cache_dir, _SafeLoadPlanner(), process_group)
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=target["model"],
        optim_state_dict=target.get("optim", {}),
    )
    return Loaded(step, store.uri(step_prefix(run_name, step)), extras["rng"], extras["state"])


def load_full(store: Store, run_name: str, step: int, cache_dir: str, optimizer: bool = True) -> Checkpoint:
    """Sharded checkpoint `step` read whole on this process (no process group), as today's full state dicts:
    `model` by parameter name, `optim` as `optimizer.state_dict()` gives it (by parameter index; empty with
    `optimizer=False`, which reads a third of the bytes into memory: an evaluator's or an export's load).
    `checkpoint.load_step` calls it for sharded checkpoints."""
    full: dict = {}
    planner = _SafeEmptyPlanner(keys=None if optimizer else {"model"})
    _, extras = _read_sharded(store, run_name, step, full, cache_dir, planner, no_dist=True)
    optim = optim_by_index(full["optim"]) if "optim" in full else {"state": {}, "param_groups": []}
    return Checkpoint(
        step=step,
        uri=store.uri(step_prefix(run_name, step)),
        model=full["model"],
        optim=optim,
        rng=extras["rng"],
        state=extras["state"],
    )


def optim_by_index(optim: dict) -> dict:
    """An optimizer state dict keyed by parameter name (get_state_dict's) -> keyed by index (torch's own)."""
    ids: dict[str, int] = {}
    groups = []
    for group in optim["param_groups"]:
        groups.append({**group, "params": [ids.setdefault(name, len(ids)) for name in group["params"]]})
    return {"state": {ids[name]: s for name, s in optim["state"].items()}, "param_groups": groups}


def clean_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP, torch.compile, activation checkpointing)."""
    wrappers = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
    return ".".join(part for part in name.split(".") if part not in wrappers)


def optim_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, optim: dict) -> dict:
    """An index-keyed optimizer state dict -> keyed by name, the names of `optimizer`'s parameters in `model`
    (its param_groups must list the parameters in the order of the optimizer that saved it)."""
    names = {p: clean_name(n) for n, p in model.named_parameters()}
    if len(optim["param_groups"]) != len(optimizer.param_groups):
        raise UserError(
            f"the checkpoint's optimizer has {len(optim['param_groups'])} parameter groups, this one "
            f"{len(optimizer.param_groups)}; build the optimizer with the groups it was saved with"
        )
    state, groups = {}, []
    for saved, live in zip(optim["param_groups"], optimizer.param_groups):
        if len(saved["params"]) != len(live["params"]):
            raise UserError(
                "the checkpoint's optimizer groups its parameters differently from this one; build the "
                "optimizer with the groups it was saved with"
            )
        fqns = [names[p] for p in live["params"]]
        state.update({fqn: optim["state"][i] for i, fqn in zip(saved["params"], fqns) if i in optim["state"]})
        groups.append({**saved, "params": fqns})
    return {"state": state, "param_groups": groups}


def load_full_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ckpt: Checkpoint) -> None:
    """Full state dicts (today's `ddp` checkpoints, or `load_full`'s) into a model, FSDP2-wrapped or plain.

    Every rank calls it with the whole state (each shards what it holds)."""
    options = StateDictOptions(full_state_dict=True)
    optim = optim_by_name(model, optimizer, ckpt.optim) if optimizer is not None else {}
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=ckpt.model,
        optim_state_dict=optim,
        options=options,
    )


def load_any(
    store: Store,
    run_name: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cache_dir: str,
    process_group=None,
) -> Loaded:
    """Checkpoint `step`, sharded or full (`ddp`), into `model` and `optimizer` (FSDP2-wrapped or plain)."""
    if is_sharded(checkpoint.read_manifest(store, run_name, step)):
        return load_sharded(store, run_name, step, model, optimizer, cache_dir, process_group)
    ckpt = checkpoint.load_step(store, run_name, step, cache_dir)
    load_full_into(model, optimizer, ckpt)
    return Loaded(ckpt.step, ckpt.uri, ckpt.rng, ckpt.state)


def find_latest_sharded(
    store: Store,
    run_name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cache_dir: str,
    process_group=None,
    read_attempts: int = 3,
    backoff_s: float = 2.0,
) -> tuple[Loaded | None, list[int]]:
    """(the newest checkpoint, either format, loaded into `model` and `optimizer`; the damaged steps skipped),
    as `checkpoint.find_latest`: a damaged one is skipped with a warning naming it, a read error retried and
    then raised. Every rank calls it: they try rank 0's list of complete steps, and all skip a checkpoint
    that any rank found damaged, or all retry a read that any rank could not make."""
    steps = _agree(checkpoint.complete_steps(store, run_name), process_group)

    def load(step: int) -> Loaded:
        loaded, error = None, None
        try:
            loaded = load_any(store, run_name, step, model, optimizer, cache_dir, process_group)
        except Exception as e:
            error = e
        said = None if error is None else (isinstance(error, DamagedCheckpoint), str(error).splitlines()[0])
        failed = [(rank, s) for rank, s in enumerate(_gather(said, process_group)) if s]
        if not failed:
            return loaded
        damaged = [(rank, s) for rank, s in failed if s[0]]
        if damaged:
            raise error if isinstance(error, DamagedCheckpoint) else DamagedCheckpoint(damaged[0][1][1])
        raise error if error is not None else RuntimeError(f"rank {failed[0][0]}: {failed[0][1][1]}")

    return checkpoint.find_latest(store, run_name, cache_dir, read_attempts, backoff_s, loader=load, steps=steps)


def load_latest_sharded(
    store: Store,
    run_name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cache_dir: str,
    process_group=None,
) -> Loaded | None:
    """The newest checkpoint (either format) that loads into `model` and `optimizer` (find_latest_sharded)."""
    return find_latest_sharded(store, run_name, model, optimizer, cache_dir, process_group)[0]
