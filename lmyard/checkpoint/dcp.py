"""The `dcp` format: every rank writes its own shards with torch.distributed.checkpoint (train.parallel=fsdp).

    runs/<run>/checkpoints/step_NNNNNNNN/dcp/.metadata        DCP's index of every tensor chunk (rank 0)
                                         dcp/__R_0.distcp     rank R's shards of model + optimizer
                                         ranks/rank_RRRRR.json  rank R's files, sizes + sha256: "uploaded"
                                         rng.pt               RNG states of every rank (rank 0)
                                         state.json           step, data cursor, config, ... (rank 0)
                                         manifest.json        Manifest(format="dcp"): every file above but
                                                              the markers; written last

Design notes: docs/checkpoints.md, `lmyard/checkpoint/dcp.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from lmyard.checkpoint.commit import DISCARD_WAIT_S, Parked, RetryPolicy, ensure_new, outage, publish, upload_files
from lmyard.checkpoint.manifest import FileMeta, Manifest, file_meta
from lmyard.checkpoint.pinned import pinned_empty
from lmyard.checkpoint.ranks import agree, distributed, rank_world
from lmyard.errors import StoreOutage
from lmyard.run import Run

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
    and stretches steps while it runs (the trainer makes the cache in the background after step 1); and its
    pages are lmyard.checkpoint.pinned's, which do not stall the training thread's launches."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t if isinstance(t, DTensor) else torch.tensor(0, dtype=t.dtype)
        if not isinstance(t, DTensor):
            return pinned_empty(t.shape, t.dtype)
        out = torch.empty_like(t, device="cpu")
        assert isinstance(out, DTensor), "empty_like keeps a DTensor's type and sharding"
        with torch.no_grad():
            local = out.to_local()  # the DTensor's own local tensor: its storage is swapped for pinned pages
            if local.numel():
                pages = pinned_empty((local.untyped_storage().nbytes(),), torch.uint8)
                local.set_(pages.untyped_storage(), local.storage_offset(), local.shape, local.stride())
        return out

    return tree_map_only(torch.Tensor, empty, sd)


class ShardedCheckpointer:
    """Saves sharded checkpoints in the background; every rank makes one (see the module doc).

    Construct it on every rank at the same point (it makes a gloo process group, a collective).
    """

    sharded = True  # loads go into the sharded model, each rank reading its shards
    commit_timeout_s = 1800.0  # how long rank 0's commit waits for every rank's upload (an instance may set less)

    def __init__(
        self,
        run: Run,
        staging_dir: str,
        *,
        async_staging: bool | None = None,
        write_threads: int = 1,
        max_pending: int = 2,
        retries: int = 6,
        backoff_s: float = 1.0,
        on_commit: Callable[[int, str], None] | None = None,
        say: Callable[[str], None] = print,
        process_group=None,
    ):
        self.run, self.store = run, run.store
        self.policy = RetryPolicy(retries, backoff_s, say, run.store)
        self.max_pending, self.layout = max_pending, run.layout
        self.stopping = threading.Event()  # set by close(): the upload thread stops retrying
        self.on_commit, self.say = on_commit or (lambda step, uri: None), say
        self.owns_group = process_group is None and distributed()
        self.group = dist.new_group(backend="gloo") if self.owns_group else process_group
        self.rank, self.world = rank_world(self.group)
        self.attempt = agree(uuid.uuid4().hex, self.group)  # markers of an earlier attempt at a step don't count
        self.staging = os.path.join(staging_dir, run.name)
        self.write_threads = write_threads  # DCP's writer threads, one file each per rank
        self._make_stager(async_staging)
        self.writing: Future | None = None  # DCP future of the newest save: its staged buffers are reused by the next
        self.staged: Future | None = None  # future of the newest save's staging (async_staging only)
        self.prepared: Future | None = None  # the background making of the staging buffers (prepare)
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.unfinished: list[int] = []  # steps saved but not yet uploaded (on rank 0: committed)
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.discarded = False  # discard(): what is staged is given up, nothing more is uploaded
        self.blocked_s: list[float] = []
        self.timings: list[dict] = []  # per save: seconds from save() until written, uploaded, committed (rank 0)
        self.thread = threading.Thread(target=self._work, daemon=True, name="sharded-checkpoint-uploader")
        self.thread.start()

    def _make_stager(self, async_staging: bool | None) -> None:
        """The stager, or on torch < 2.12 the writer that stages: DCP's stager before 2.12 cannot copy a
        DTensor's spec (KeyError: <class 'type'>, then unbounded recursion), so the writer stages instead, a
        blocking copy into pinned buffers it keeps (cache_staged_state_dict) between saves. From 2.12: DCP's
        stager (reused pinned buffers, optionally on a side stream)."""
        cuda = torch.cuda.is_available()
        self.async_staging = cuda if async_staging is None else async_staging and cuda
        self.stager, self.writer = None, None
        if _torch_at_least(2, 12):
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=self.async_staging,
                use_non_blocking_copy=cuda,
            )
            self.stager = _stager_copying_classes(DefaultStager(options))
        else:
            self.async_staging = False
            self.writer = dcp.FileSystemWriter(
                self.staging, thread_count=self.write_threads, cache_staged_state_dict=cuda
            )

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
        self.discarded = True
        self.stopping.set()
        self.policy.closing.set()
        self.policy.wake.set()
        self.jobs.put(None)
        if self.writing is not None:  # DCP's write in flight would outlive the delete: it ends first
            with contextlib.suppress(Exception):  # its error (the full disk) is the one being handled
                self.writing.result(timeout=DISCARD_WAIT_S)
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
        if self.discarded:  # given up while it was written: its folder is being deleted
            return
        times = {"step": job.step, "written_s": time.perf_counter() - job.t0}
        new = lambda: ensure_new(self.run, job.step)
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
            uri = publish(self.run, extra, manifest, self.policy, self.staging)

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


def _commit_folder(job: _Job) -> str:
    """Rank 0's folder for rng.pt and state.json: beside the step's folder, not in it, since another rank of
    the node removes the step's folder once it is empty (a mkdir in it could lose that race)."""
    return f"{os.path.dirname(job.folder)}-commit"
