"""Where things live in the store: the one owner of every key under `runs/<run>/`, `shards/<address>/` and
`compile/`.

Design notes: docs/tracking.md, `lmyard/layout.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MANIFEST = "manifest.json"
RUNS = "runs"  # the folder of every lineage
COMPILE = "compile"  # compiled code, shared by every lineage whose key matches (lmyard.train.compile_cache)
EVALUATED = "evaluated.json"
_STEP_DIR = re.compile(r"(?:^|/)step_(\d{8})(?:/|$)")
_DAMAGED_DIR = re.compile(r"/damaged/step_(\d{8})-[^/]+/")
_RUN_URI = re.compile(
    r"^(?P<root>.+?)/runs/(?P<run>[A-Za-z0-9][A-Za-z0-9._-]*)(?:/checkpoints(?:/step_(?P<step>\d{8}))?)?/?$"
)


@dataclass(frozen=True)
class RunLayout:
    """The keys of one lineage (`run_name`) in the store."""

    run_name: str

    @property
    def root(self) -> str:
        return f"{RUNS}/{self.run_name}"

    @property
    def lineage(self) -> str:
        return f"{self.root}/lineage.json"

    @property
    def lease(self) -> str:
        return f"{self.root}/lease.json"

    @property
    def protected(self) -> str:
        return f"{self.root}/protected.json"

    @property
    def checkpoints(self) -> str:
        return f"{self.root}/checkpoints"

    def step(self, step: int) -> str:
        return f"{self.checkpoints}/step_{step:08d}"

    def step_file(self, step: int, name: str) -> str:
        return f"{self.step(step)}/{name}"

    def manifest(self, step: int) -> str:
        return self.step_file(step, MANIFEST)

    def evaluated(self, step: int) -> str:
        return self.step_file(step, EVALUATED)

    def rank_markers(self, step: int) -> str:
        """The folder of a sharded checkpoint's upload markers, one object per rank."""
        return self.step_file(step, "ranks")

    def rank_marker(self, step: int, rank: int) -> str:
        return f"{self.rank_markers(step)}/rank_{rank:05d}.json"

    @property
    def damaged_root(self) -> str:
        return f"{self.root}/damaged"

    def damaged(self, step: int, stamp: str) -> str:
        return f"{self.damaged_root}/step_{step:08d}-{stamp}"

    @staticmethod
    def damaged_step_of(key: str) -> tuple[int, str] | None:
        """(step, folder) of a key inside a moved-aside checkpoint (`runs/<run>/damaged/step_N-<time>/...`)."""
        m = _DAMAGED_DIR.search(key)
        return (int(m.group(1)), key[: m.end() - 1]) if m else None

    @staticmethod
    def locate(uri: str) -> tuple[str, str, int | None] | None:
        """(store root, run name, step or None) of `STORE/runs/RUN[/checkpoints[/step_NNNNNNNN]]`, else None."""
        m = _RUN_URI.match(uri.rstrip("/"))
        return (m["root"], m["run"], int(m["step"]) if m["step"] else None) if m else None

    @staticmethod
    def step_of(key: str) -> int | None:
        """The step of a key inside a checkpoint folder (`.../step_00000100/...`), else None."""
        m = _STEP_DIR.search(key)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ShardLayout:
    """The keys of one shard set (`address`) in the store."""

    address: str

    @property
    def root(self) -> str:
        return f"shards/{self.address}"

    @property
    def manifest(self) -> str:
        return f"{self.root}/{MANIFEST}"

    def file(self, name: str) -> str:
        """A shard by its manifest name (`train_000000.bin`)."""
        return f"{self.root}/{name}"

    def sidecar(self, name: str) -> str:
        """The resume sidecar of shard `name`: its manifest entry and the cursor after it."""
        return f"{self.root}/{name.removesuffix('.bin')}.json"

    @staticmethod
    def shard_name(split: str, index: int) -> str:
        """The name of a split's index-th shard (`val_000003.bin`): its file name here and in a local cache."""
        return f"{split}_{index:06d}.bin"


def compile_cache(key: str, name: str) -> str:
    """torch.compile's cache artifacts for one key (`KEY.WRITER-N.bin`) and their record (`KEY.json`): the store's,
    not one lineage's (lmyard.train.compile_cache)."""
    return f"{COMPILE}/{key}.{name}"
