"""Loading the `dcp` format (written by lmyard.checkpoint.dcp, which describes its files).

`load_sharded` reshards to any world size; `load_full` reads a sharded checkpoint on one process into full
state dicts; `load_full_into` puts full state dicts into a sharded model. A damaged or missing file raises
DamagedCheckpoint naming it.

Design notes: docs/checkpoints.md, `lmyard/checkpoint/dcp_load.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lmyard.checkpoint.catalog import read_manifest
from lmyard.checkpoint.dcp import DCP_DIR, state_dict
from lmyard.checkpoint.manifest import DamagedCheckpoint, Manifest, check_file
from lmyard.checkpoint.readahead import LANES, FileJob, ReadAhead, memory, tensor_in
from lmyard.checkpoint.schema import CheckpointState
from lmyard.checkpoint.state import Checkpoint, Loaded
from lmyard.errors import UserError
from lmyard.paths import confined
from lmyard.run import Run
from lmyard.store import Store


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
    run: Run,
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
    store, prefix = run.store, run.layout.step(step)
    manifest = read_manifest(run, step)
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
    run: Run,
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
    _, extras = _read_sharded(run, step, target, cache_dir, planner, process_group, phases=phases)
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=target["model"],
        optim_state_dict=target.get("optim", {}),
    )
    return Loaded(step, run.uri(run.layout.step(step)), extras["rng"], extras["state"])


def load_full(run: Run, step: int, cache_dir: str, optimizer: bool = True) -> Checkpoint:
    """Sharded checkpoint `step` read whole on this process (no process group), as today's full state dicts:
    `model` by parameter name, `optim` as `optimizer.state_dict()` gives it (by parameter index; empty with
    `optimizer=False`, which reads a third of the bytes into memory: an evaluator's or an export's load).
    `resume.load_step` calls it for sharded checkpoints."""
    full: dict = {}
    planner = _SafeEmptyPlanner(keys=None if optimizer else {"model"})
    _, extras = _read_sharded(run, step, full, cache_dir, planner, no_dist=True)
    optim = optim_by_index(full["optim"]) if "optim" in full else {"state": {}, "param_groups": []}
    return Checkpoint(
        step=step,
        uri=run.uri(run.layout.step(step)),
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
