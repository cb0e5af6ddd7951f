"""The `dcp` format: every rank writes its own shards with torch.distributed.checkpoint (train.parallel=fsdp).

    runs/<run>/checkpoints/step_NNNNNNNN/dcp/.metadata        DCP's index of every tensor chunk (rank 0)
                                         dcp/__R_0.distcp     rank R's shards of model + optimizer
                                         ranks/rank_RRRRR.json  rank R's files, sizes + sha256: "uploaded"
                                         rng.pt               RNG states of every rank (rank 0)
                                         state.json           step, data cursor, config, ... (rank 0)
                                         manifest.json        Manifest(format="dcp"): every file above but
                                                              the markers; written last

The manifest, the commit (files first, manifest last), the retry policy and the
checksums are those of the `full` format (lmyard.checkpoint.manifest, .commit),
so the catalog, lmyard.checkpoint.resume.find_latest and retention treat a
sharded checkpoint like any other.

Saving (`ShardedCheckpointer.save`, called by every rank): the loop is blocked
while DCP stages this rank's shards into reused CPU buffers (pinned on GPUs; with
`async_staging` the copy runs on a side stream and only `before_update()` waits
for it). DCP then writes them to a node-local folder in its own thread (its
collectives use a gloo group of their own), and this rank's upload thread puts its
files into the store and writes its marker object `ranks/rank_RRRRR.json` (a
store that fails parks the checkpoint, as for the full format: training goes on
until `max_pending` checkpoints wait, then save() raises StoreOutage). Rank 0
waits until every rank's marker exists, then writes rng.pt, state.json and the
manifest. Markers rather than a collective: the ranks of different nodes share no
filesystem and rank 0 needs every file's checksum; a marker carries them, a slow
or failed upload of one rank never stalls a collective in the other ranks, and
rank 0 gives up after `commit_timeout_s` leaving the step without a manifest
(invisible).

Loading (`load_sharded`) reshards to any world size (DCP plans the reads from
the target's DTensor placements). A rank writes `write_threads` files
(checkpoint.files_per_rank) and hashes them in parallel; each file is read once,
front to back, into a few reused buffers (pinned on CUDA) by a thread while a
second hashes it, four files at a time (lmyard.checkpoint.readahead); the
reader's `read_data` builds each tensor as a view of its span's bytes and copies
it once into the target (DCP's own loop would torch.load each span into a fresh
storage first);
a damaged or missing file raises DamagedCheckpoint naming it, so
resume.find_latest falls back to the previous checkpoint on every rank together.
`load_full` reads a sharded checkpoint on one process, without a process group,
into full state dicts (`state.Checkpoint`: model by name, optimizer by parameter
index), what resume.load_step returns for either format; `load_full_into` puts
full state dicts into a sharded model. Non-tensor values and DCP's metadata are
unpickled with restricted loaders: a checkpoint from a shared bucket cannot run
code.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from lmyard.checkpoint.catalog import read_manifest
from lmyard.checkpoint.commit import Parked, RetryPolicy, ensure_new, outage, publish, upload_files
from lmyard.checkpoint.manifest import DamagedCheckpoint, FileMeta, Manifest, check_file, file_meta
from lmyard.checkpoint.ranks import agree, distributed, rank_world
from lmyard.checkpoint.readahead import LANES, FileJob, ReadAhead, memory, tensor_in
from lmyard.checkpoint.schema import CheckpointState
from lmyard.checkpoint.state import Checkpoint, Loaded
from lmyard.errors import StoreOutage, UserError
from lmyard.layout import RunLayout
from lmyard.paths import confined
from lmyard.store import Store

DCP_DIR = "dcp"


# ---------------------------------------------------------------- writing


@dataclass
class _Job:
    step: int
    folder: str  # this rank's staging folder
    future: Future  # DCP's write future
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
            return _copy_as_itself
        raise KeyError(key)


def _copy_as_itself(x, memo):
    """What `copy` does with atoms (copy._deepcopy_atomic, private): the object itself."""
    return x


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

        setattr(cls, "__init__", init)  # noqa: B010 (mypy refuses assigning to a method; patching is the point)
        setattr(cls, "_lmyard_copies_classes", True)  # noqa: B010 (a marker the class does not declare)
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None and not isinstance(getattr(inner, "_deepcopy_dispatch", None), _CopyTable):
        inner._deepcopy_dispatch = _CopyTable(inner._deepcopy_dispatch)
    return stager


def pinned_like(sd: dict) -> dict:
    """Empty pinned CPU tensors of `sd`'s structure, shapes and dtypes (DTensors keep their sharding): the
    cache DCP's writer stages into (`state_dict_cache`). Unlike torch's `_create_cpu_state_dict` it copies no
    values: that one moves every shard to pageable host memory first, which occupies the training stream
    and stretches steps while it runs (the trainer makes the cache in the background after step 1)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t if isinstance(t, DTensor) else torch.tensor(0, dtype=t.dtype)
        local = t.to_local() if isinstance(t, DTensor) else t
        pin = local.numel() > 0 and local.data_ptr() != 0  # an empty shard cannot be pinned
        return torch.empty_like(t, device="cpu", pin_memory=pin)

    return tree_map_only(torch.Tensor, empty, sd)


class ShardedCheckpointer:
    """Saves sharded checkpoints in the background; every rank makes one (see the module doc).

    Construct it on every rank at the same point (it makes a gloo process group, a collective).
    """

    sharded = True  # loads go into the sharded model, each rank reading its shards

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
        self.policy, self.commit_timeout_s = RetryPolicy(retries, backoff_s, say, store), commit_timeout_s
        self.max_pending, self.layout = max_pending, RunLayout(run_name)
        self.stopping = threading.Event()  # set by close(): the upload thread stops retrying
        self.on_commit, self.say = on_commit or (lambda step, uri: None), say
        self.owns_group = process_group is None and distributed()
        self.group = dist.new_group(backend="gloo") if self.owns_group else process_group
        self.rank, self.world = rank_world(self.group)
        self.attempt = agree(uuid.uuid4().hex, self.group)  # markers of an earlier attempt at a step don't count
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
        self.writing: Future | None = None  # DCP future of the newest save: its staged buffers are reused by the next
        self.staged: Future | None = None  # future of the newest save's staging (async_staging only)
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
        self.policy.wake.set()  # a parked checkpoint tries again
        if len(self.unfinished) >= self.max_pending:
            raise outage(
                f"{len(self.unfinished)} checkpoints (steps {self.unfinished}) are waiting for {self.store.root}",
                self.policy,
                self.staging,
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
        # DCP returns the write's future, or (with a stager) a response holding it and the staging's future
        writing = out if isinstance(out, Future) else out.upload_completion
        self.writing, self.staged = writing, None if isinstance(out, Future) else out.staging_completion
        with self.cond:
            self.unfinished.append(step)
        self.jobs.put(_Job(step, folder, writing, dict(state), rng, t0))
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        return blocked

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Make the staging buffers (pinned host memory: seconds for GBs) in the background, so the first save
        blocks no longer than later ones. Call once the optimizer has its state (after the first step).

        With DCP's stager (torch >= 2.12) a throwaway staging fills its buffer cache; before, the writer's
        cache (`state_dict_cache`, what `cache_staged_state_dict` keeps between saves) is made directly:
        pinned tensors of the state's shapes, with no copy of their values."""
        writer, stager = self.writer, self.stager
        if writer is not None and (not writer.cache_staged_state_dict or writer.state_dict_cache is not None):
            return  # the writer keeps no cache (CPU) or has made it already
        sd, prepared = state_dict(model, optimizer), Future[None]()
        self.prepared = prepared
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def make() -> None:
            try:
                if device is not None:  # a new thread starts on GPU 0: a context there would cost memory
                    torch.cuda.set_device(device)
                if writer is not None:
                    writer.state_dict_cache = pinned_like(sd)
                elif stager is not None:
                    staged = stager.stage(sd)  # a throwaway copy: it only fills the stager's buffer cache
                    if isinstance(staged, Future):
                        staged.result()
                prepared.set_result(None)
            except BaseException as e:
                prepared.set_exception(e)

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
        self.policy.wake.set()  # a parked checkpoint tries again now
        with self.cond:
            while self.unfinished and self.error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise outage(
                        f"checkpoints of steps {self.unfinished} are still not in {self.store.root} "
                        f"after {timeout_s:.0f} s",
                        self.policy,
                        self.staging,
                    )
                self.cond.wait(timeout=1 if left is None else min(1, left))
        self._raise_if_failed()

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for every checkpoint, then stop the upload thread and free the staging buffers. No save comes
        after: a checkpoint still failing gets one more round of retries, then the error (never a wait forever)."""
        self.stopping.set()
        self.policy.closing.set()
        self.policy.wake.set()
        try:
            self.flush(timeout_s)
        finally:
            self.jobs.put(None)
            self.thread.join(5)
            if self.stager is not None:
                self.stager.close()

    def discard(self) -> None:
        """Stop without waiting and delete this rank's staging folder (a full disk: its space goes back; what was
        not committed is lost, and a rerun resumes from the last committed checkpoint)."""
        self.stopping.set()
        self.policy.closing.set()
        self.policy.wake.set()
        self.jobs.put(None)
        shutil.rmtree(self.staging, ignore_errors=True)

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
        new = lambda: ensure_new(self.store, self.run_name, job.step)
        self._persist(lambda: self.policy.run(job.step, self.staging, new))  # a complete step: StepExists
        names = sorted(os.listdir(job.folder))
        with ThreadPoolExecutor(max(1, min(len(names), 8))) as pool:  # sha256: one thread a file
            metas = pool.map(file_meta, [os.path.join(job.folder, name) for name in names])
            files = {f"{DCP_DIR}/{name}": meta for name, meta in zip(names, metas)}
        keys = {self.layout.step_file(job.step, f"{DCP_DIR}/{n}"): os.path.join(job.folder, n) for n in names}
        self._persist(lambda: upload_files(self.store, keys, job.step, self.policy, self.staging))
        marker = {"rank": self.rank, "attempt": self.attempt, "files": {k: m.model_dump() for k, m in files.items()}}
        body, key = json.dumps(marker).encode(), self.layout.rank_marker(job.step, self.rank)
        self._persist(lambda: self.policy.run(job.step, self.staging, lambda: self.store.write_bytes(key, body)))
        shutil.rmtree(job.folder, ignore_errors=True)
        times.update(uploaded_s=time.perf_counter() - job.t0, bytes=sum(m.bytes for m in files.values()))
        if self.rank == 0:
            uri = self._commit(job)
            times["committed_s"] = time.perf_counter() - job.t0
            shutil.rmtree(_commit_folder(job), ignore_errors=True)
        with contextlib.suppress(OSError):  # the step's folder, once the node's last rank is done with it
            os.rmdir(os.path.dirname(job.folder))
        self.timings.append(times)
        if self.rank == 0:
            self.on_commit(job.step, uri)

    def _persist(self, upload: Callable[[], object]) -> None:
        """Run `upload` (under the retry policy) until it succeeds; parked between rounds (lmyard.checkpoint.commit)
        until the next save or flush; after close() a spent round raises StoreOutage."""
        while True:
            try:
                upload()
                return
            except Parked:
                if self.stopping.is_set():
                    raise
                self.policy.wait()

    def _commit(self, job: _Job) -> str:
        """Rank 0: once every rank's marker is in the store, write rng.pt, state.json, then the manifest."""
        files = {}
        for marker in self._wait_for_markers(job.step):
            files.update({name: FileMeta(**meta) for name, meta in marker["files"].items()})
        folder = _commit_folder(job)
        os.makedirs(folder, exist_ok=True)
        extra = {"rng.pt": os.path.join(folder, "rng.pt"), "state.json": os.path.join(folder, "state.json")}
        torch.save(job.rng or [], extra["rng.pt"])
        Path(extra["state.json"]).write_text(json.dumps(job.state, indent=1))
        files.update({name: file_meta(path) for name, path in extra.items()})
        manifest = Manifest(
            format="dcp", step=job.step, val_loss=job.state.get("val_loss"), world_size=self.world, files=files
        )
        uri = None

        def commit() -> None:
            nonlocal uri
            uri = publish(self.store, self.run_name, extra, manifest, self.policy, self.staging)

        self._persist(commit)
        assert uri is not None, "_persist returns only once commit() has run"
        return uri

    def _wait_for_markers(self, step: int) -> list[dict]:
        """Every rank's marker (one listing per poll: a few requests, whatever the world size)."""
        deadline, found = time.monotonic() + self.commit_timeout_s, dict[int, dict]()
        while len(found) < self.world:
            with contextlib.suppress(Exception):  # the store failing now is like a marker not there yet
                for key in self.store.list(self.layout.rank_markers(step)):
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


def state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """{"model": ..., "optim": ...}: this rank's shards (DTensors under FSDP2), keyed by parameter name."""
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


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

    def __init__(self, store: Store, prefix: str, manifest: Manifest, local_dir: str):
        in_place = store.local_path(f"{prefix}/{DCP_DIR}")
        super().__init__(in_place or local_dir)
        self.store, self.prefix, self.manifest, self.in_place = store, prefix, manifest, in_place is not None
        self.fetched: set[str] = set()
        self.metadata = None
        self.ahead: ReadAhead | None = None
        self.phases: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds per phase

    def _local(self, name: str) -> str:
        """The local path of a file DCP's index names, downloaded unless the store is local; a file the
        manifest does not list raises DamagedCheckpoint."""
        key = f"{self.prefix}/{DCP_DIR}/{name}"
        path = confined(str(self.path), name, "checkpoint file")  # names come from files in the store
        if f"{DCP_DIR}/{name}" not in self.manifest.files:
            raise DamagedCheckpoint(f"{self.store.uri(key)} is not in the checkpoint's manifest")
        if not self.in_place and name not in self.fetched:
            self.store.download(key, path)  # a failed read is not damage: raised as it is, then retried
            self.fetched.add(name)
        return path

    def load_metadata(self):
        """DCP's index, checked and unpickled safely; called before dcp.load, whose own wrapping of a failed
        read would hide that the checkpoint is damaged."""
        if self.metadata is None:
            key = f"{self.prefix}/{DCP_DIR}/.metadata"
            path = check_file(self.manifest, f"{DCP_DIR}/.metadata", self._local(".metadata"), self.store.uri(key))
            with open(path, "rb") as f:
                try:
                    self.metadata = _SafeUnpickler(f).load()
                except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
                    raise DamagedCheckpoint(f"{self.store.uri(key)} does not load: {e}") from None
            storage_meta = getattr(self.metadata, "storage_meta", None)  # absent from older checkpoints' index
            if storage_meta is not None:
                storage_meta.load_id = self.load_id
        return self.metadata

    def read_metadata(self, *args, **kwargs):
        return self.load_metadata()

    def read_data(self, plan, planner):
        """DCP's reads in file and offset order, each file read once by a ReadAhead that checks its sha256
        (lmyard.checkpoint.readahead); a damaged file raises DamagedCheckpoint naming it."""
        info = self.storage_data
        items = sorted(plan.items, key=lambda i: (info[i.storage_index].relative_path, info[i.storage_index].offset))
        jobs: dict[str, FileJob] = {}
        for item in items:
            md = info[item.storage_index]
            if (name := md.relative_path) not in jobs:
                path, uri = self._local(name), self.store.uri(f"{self.prefix}/{DCP_DIR}/{name}")
                jobs[name] = FileJob(name, path, uri, self.manifest.files[f"{DCP_DIR}/{name}"].sha256)
            if (span := (md.offset, md.length)) not in jobs[md.relative_path].spans[-1:]:
                jobs[md.relative_path].spans.append(span)
        tensors = [i for i in items if i.type != LoadItemType.BYTE_IO]
        device = planner.resolve_tensor(tensors[0]).device if tensors else None
        transformed = any(getattr(info[i.storage_index], "transform_descriptors", None) for i in items)
        # DCP's own loop (items it saved transformed) asks for the spans in order: one lane
        self.ahead = ahead = ReadAhead(list(jobs.values()), device=device, lanes=1 if transformed else LANES)
        try:
            if transformed:
                super().read_data(dataclasses.replace(plan, items=items), planner)  # _slice_file below
            else:
                self._load_items(ahead, items, planner)
        except Exception:
            ahead.close()
            for job in jobs.values():  # a damaged file is the likelier cause: name it (a full check)
                if not job.verified:
                    check_file(self.manifest, f"{DCP_DIR}/{job.name}", job.path, job.uri)
            raise
        ahead.finish()
        self.phases.update(ahead.phases)
        done: torch.futures.Future = torch.futures.Future()  # what DCP waits on
        done.set_result(None)
        return done

    def _load_items(self, ahead: ReadAhead, items, planner) -> None:
        """What DCP's FileSystemReader.read_data does with each item, on the read-ahead's buffers, in the order
        its lanes hash the spans (the items of one span together)."""
        waiting: dict[tuple[str, int, int], list] = collections.defaultdict(list)
        for item in items:
            md = self.storage_data[item.storage_index]
            waiting[(md.relative_path, md.offset, md.length)].append(item)
        while (got := ahead.next_span()) is not None:
            key, span = got
            for item in waiting.pop(key, []):
                self._load_item(item, span, planner)
        if waiting:  # every file was read to its end: the plan's offsets are not in the files
            raise RuntimeError(f"checkpoint spans never read: {sorted(waiting)[:3]}")

    def _load_item(self, item, span: torch.Tensor, planner) -> None:
        """One item from its span's bytes: a tensor is a view of them (readahead.tensor_in), copied once into
        the target (on the GPU from pinned memory, without waiting)."""
        phases, clock = self.phases, time.perf_counter
        t0 = clock()
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(memory(span))))
            phases["bytes"] += clock() - t0
            return
        tensor = narrow_tensor_by_index(tensor_in(span), item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        t1 = clock()
        target.copy_(tensor, non_blocking=True)
        planner.commit_tensor(item, target)
        phases["deserialise"] += t1 - t0
        phases["copy"] += clock() - t1

    def _slice_file(self, file, sinfo):
        """DCP's own read_data (only for items it saved transformed): a span's bytes as a file."""
        assert self.ahead is not None, "read_data sets the read-ahead before DCP reads a slice"
        span = self.ahead.take(sinfo.relative_path, sinfo.offset, sinfo.length)
        return io.BytesIO(bytes(memory(span)))


def _commit_folder(job: _Job) -> str:
    """Rank 0's folder for rng.pt and state.json: beside the step's folder, not in it, since another rank of
    the node removes the step's folder once it is empty (a mkdir in it could lose that race)."""
    return f"{os.path.dirname(job.folder)}-commit"


def _fetch(store: Store, prefix: str, manifest: Manifest, name: str, local_dir: str) -> str:
    """A checkpoint file checked against the manifest: its local path (downloaded unless the store is local)."""
    key = f"{prefix}/{name}"
    path = store.local_path(key)
    if path is None:
        path = os.path.join(local_dir, name)
        store.download(key, path)  # a failed read is not damage: raised as it is
    return check_file(manifest, name, path, store.uri(key))


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
    phases: dict | None = None,
) -> tuple[Manifest, dict]:
    """Fill `state` (a state dict, empty with _SafeEmptyPlanner) from checkpoint `step`; (manifest, extras).
    `phases`, if given, gets this rank's seconds per phase of the read (_VerifiedReader.phases)."""
    prefix = RunLayout(run_name).step(step)
    manifest = read_manifest(store, run_name, step)
    if manifest.format != "dcp":
        raise DamagedCheckpoint(f"{store.uri(prefix)} is not a sharded checkpoint (format {manifest.format})")
    local = os.path.join(cache_dir, "checkpoint-load", str(os.getpid()), prefix)
    try:
        reader = _VerifiedReader(store, prefix, manifest, os.path.join(local, DCP_DIR))
        _check_masters(state, reader.load_metadata(), store.uri(prefix))
        try:
            if state:
                dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
            else:  # dcp.load fills only the keys it is given; this fills an empty dict (_load_state_dict_from_keys)
                _load_state_dict(state_dict=state, storage_reader=reader, planner=planner, no_dist=True)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _unwrap(e) from None
        if phases is not None:
            phases.update(reader.phases)
        with open(_fetch(store, prefix, manifest, "state.json", local)) as f:
            extras = {
                "state": CheckpointState.model_validate_json(f.read()),
                "rng": torch.load(_fetch(store, prefix, manifest, "rng.pt", local), weights_only=True),
            }
    finally:
        if store.local_path(prefix) is None:
            shutil.rmtree(local, ignore_errors=True)
    return manifest, extras


def _check_masters(state: dict, metadata, uri: str) -> None:
    """A UserError, before any tensor is read, where the optimizer keeps float32 master weights
    (train.fsdp_param_dtype=bfloat16) and the checkpoint, saved with float32 shards, has none."""
    optim = state.get("optim", {}).get("state", {})
    missing = [
        fqn
        for fqn, s in optim.items()
        if "master" in s and f"optim.state.{fqn}.master" not in metadata.state_dict_metadata
    ]
    if missing:
        raise UserError(
            f"{uri} was saved with float32 shards: its optimizer state has no master weights ({missing[0]}, ...); "
            "resume it with train.fsdp_param_dtype=float32"
        )


def load_sharded(
    store: Store,
    run_name: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cache_dir: str,
    process_group=None,
    phases: dict | None = None,
) -> Loaded:
    """Load sharded checkpoint `step` into `model` (FSDP2-wrapped or plain) and `optimizer`, on any world size.

    Every rank calls it. A missing or damaged file raises DamagedCheckpoint (on every rank) naming it; a read
    that fails (the store down) raises as it is. `phases`, if given, gets this rank's seconds per phase of the
    read: read, hash, reuse, wait (readahead.ReadAhead.phases), deserialise, copy (the loading thread's).
    """
    target = state_dict(model, optimizer)
    planner = _SafeLoadPlanner()
    _, extras = _read_sharded(store, run_name, step, target, cache_dir, planner, process_group, phases=phases)
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=target["model"],
        optim_state_dict=target.get("optim", {}),
    )
    return Loaded(step, store.uri(RunLayout(run_name).step(step)), extras["rng"], extras["state"])


def load_full(store: Store, run_name: str, step: int, cache_dir: str, optimizer: bool = True) -> Checkpoint:
    """Sharded checkpoint `step` read whole on this process (no process group), as today's full state dicts:
    `model` by parameter name, `optim` as `optimizer.state_dict()` gives it (by parameter index; empty with
    `optimizer=False`, which reads a third of the bytes into memory: an evaluator's or an export's load).
    `resume.load_step` calls it for sharded checkpoints."""
    full: dict = {}
    planner = _SafeEmptyPlanner(keys=None if optimizer else {"model"})
    _, extras = _read_sharded(store, run_name, step, full, cache_dir, planner, no_dist=True)
    optim = optim_by_index(full["optim"]) if "optim" in full else {"state": {}, "param_groups": []}
    return Checkpoint(
        step=step,
        uri=store.uri(RunLayout(run_name).step(step)),
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
