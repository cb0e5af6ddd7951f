"""Compiled code travels with the lineage: torch.compile's cache artifacts in the run's store, shared by every
lineage of that store whose key matches (a retry, a sweep's trials, the next scheduled retraining).

    cache = CompileCache.of(cfg, run, world, device, rank)   the key of what makes compiled code valid
    cache.load()          every rank, before the first step: the store's artifacts into inductor's caches
    cache.save()          rank 0, after the first step (the first compile): the artifacts to the store
    cache.close()         rank 0, at the attempt's end: saved again if it compiled more (validation), the upload
                          waited for (bounded)

Design notes: docs/training.md ("Compiled code in the store"), `lmyard/train/compile_cache.py`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from dataclasses import dataclass, field

import torch

from lmyard.config import RunConfig
from lmyard.layout import COMPILE, compile_cache
from lmyard.run import Run

# train config fields that do not shape a compiled graph: a retry that changes them keeps its compiled code
NOT_COMPILED = {"max_steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "seed", "log_interval", "guard"}
NOT_COMPILED |= {"grad_clip", "threads_per_rank", "compile_cache"}
SAVE_WAIT_S = 60.0  # how long an attempt's end waits for the artifacts' upload
NEAREST_OF = 20  # stored records read to name the fields that differ, for a key the store does not hold


def key_fields(cfg: RunConfig, world: int, device: torch.device) -> dict:
    """What makes compiled code valid for this job (see the module doc)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    arch = "cpu"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    train = {k: v for k, v in cfg.train.model_dump(mode="json").items() if k not in NOT_COMPILED}
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "arch": arch,
        "world_size": world,
        "model": cfg.model.model_dump(mode="json"),
        "train": train,
    }


def digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def inductor_counts() -> dict[str, int]:
    """torch's own cache counters in this process: FX graph and AOTAutograd hits and misses."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }


@dataclass
class CompileCache:
    """One job's compile cache in the run's store (see the module doc). `loaded`: artifacts put in place."""

    run: Run
    fields: dict
    rank: int
    enabled: bool
    loaded: int = 0
    found: str = "off"  # off | loaded | none | mismatch | damaged
    saved_misses: int = 0  # torch's cache misses (graphs compiled here) at the last save
    parts: list = field(default_factory=list)  # the record's parts this process saved (name, sha256, bytes)
    writer: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # its parts' names: two lineages never mix
    thread: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def of(cls, cfg: RunConfig, run: Run, world: int, device: torch.device, rank: int):
        compiled = cfg.train.compile if cfg.train.compile is not None else device.type == "cuda"  # as wrap decides
        return cls(run, key_fields(cfg, world, device), rank, enabled=compiled and cfg.train.compile_cache)

    @property
    def key(self) -> str:
        return digest(self.fields)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(f"compile cache: {text}", flush=True)

    def load(self) -> int:
        """The store's artifacts for this key into inductor's caches; how many were loaded (0: it compiles)."""
        if not self.enabled:
            return 0
        store = self.run.store
        meta_key = compile_cache(self.key, "json")
        if not store.exists(meta_key):
            self.found = "none"
            self._say(self._no_match())
            return 0
        blobs: list[bytes] = []
        try:
            meta = json.loads(store.read_bytes(meta_key))
            problem = self._problem(meta, blobs)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"unreadable ({type(e).__name__})"
        keys: set = set()
        if problem is None:
            try:  # the record matched: torch reads what it wrote, but a cache must never stop a run
                infos = [torch.compiler.load_cache_artifacts(blob) for blob in blobs]
            except Exception as e:
                problem = f"torch could not load it ({type(e).__name__})"
            else:
                problem = None if all(infos) else "torch could not read it"
                keys = {(t, k) for info in infos if info for t, ks in info.artifacts.items() for k in ks}
        where = store.uri(compile_cache(self.key, "*"))
        if problem is not None:
            self.found = "damaged"
            self._say(f"{where} ignored: {problem}; compiling as without it")
            return 0
        self.loaded, self.found = len(keys), "loaded"
        self._say(f"loaded {self.loaded} compiled artifacts from {where}")
        return self.loaded

    def _problem(self, meta: dict, blobs: list[bytes]) -> str | None:
        """Why the record and its parts cannot be used, or None (then `blobs` holds the parts, in order)."""
        if meta.get("fields") != self.fields or digest(meta["fields"]) != self.key:
            return "its recorded key is another job's"
        for part in meta["parts"]:
            blob = self.run.store.read_bytes(compile_cache(self.key, part["name"]))
            if hashlib.sha256(blob).hexdigest() != part["sha256"]:
                return f"part {part['name']}: its sha256 does not match its record (damaged)"
            blobs.append(blob)
        return None if blobs else "its record lists no parts"

    def _no_match(self) -> str:
        """The line for a key with no artifacts: the fields that differ from the nearest key the store holds."""
        store, nearest = self.run.store, None
        for k in [k for k in store.list(COMPILE + "/") if k.endswith(".json")][:NEAREST_OF]:
            try:
                theirs = json.loads(store.read_bytes(k))["fields"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            differ = sorted(f for f in self.fields if self.fields[f] != theirs.get(f))
            nearest = differ if nearest is None or len(differ) < len(nearest) else nearest
        if nearest is None:
            return "none stored yet; compiling, then saving for the next attempt"
        self.found = "mismatch"
        return (
            f"none for this job's key ({', '.join(nearest) or 'the key'} differ from the nearest stored one); compiling"
        )

    def save(self) -> None:
        """Rank 0, after the first step and at the attempt's end: what this process compiled (its validation's
        graphs too, at the end) to the store, uploaded in the background; nothing new, nothing saved. A process
        that loaded artifacts saves nothing (torch would hand over only what it compiled itself, and the store's
        record would lose the rest): a graph the loaded ones lacked is compiled again by the next attempt."""
        if not self.enabled or self.rank != 0 or self.found == "loaded":
            return  # torch records what it compiles, not what it loaded: a save here would hold only the new part
        misses = inductor_counts()
        missed = misses["fxgraph_misses"] + misses["autograd_misses"]
        if missed == self.saved_misses:
            return  # everything came from the store, or was saved already
        saved = torch.compiler.save_cache_artifacts()  # everything this process compiled or loaded so far
        if saved is None:
            return
        self.saved_misses = missed
        blob, _ = saved
        name = f"{self.writer}-{len(self.parts)}.bin"
        self.parts.append({"name": name, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)})
        meta = {"fields": self.fields, "parts": list(self.parts)}
        if self.thread is not None:
            self.thread.join()
        args = (name, blob, meta)
        self.thread = threading.Thread(target=self._upload, args=args, daemon=True, name="compile-cache")
        self.thread.start()

    def _upload(self, name: str, blob: bytes, meta: dict) -> None:
        store, blob_key = self.run.store, compile_cache(self.key, name)
        try:  # the part first, the record that lists it last: a record always describes whole parts, this writer's
            store.write_bytes(blob_key, blob)
            store.write_bytes(compile_cache(self.key, "json"), json.dumps(meta).encode())
            self._say(f"saved {len(blob):,} bytes of compiled artifacts to {store.uri(blob_key)}")
        except Exception as e:  # the run goes on: the next attempt compiles
            self._say(f"not saved ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")

    def report(self) -> dict | None:
        """For the TrainResult (lmyard.stages.results.CompileReport): what was found and torch's counters; None when off."""
        if not self.enabled:
            return None
        return {"found": self.found, "loaded": self.loaded, **inductor_counts()}

    def close(self) -> None:
        """The attempt's end: what it compiled since the first step saved too, the upload waited for (bounded)."""
        self.save()
        if self.thread is not None:
            self.thread.join(SAVE_WAIT_S)
