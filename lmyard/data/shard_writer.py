"""Writing the shards of tokenize-and-shard (lmyard.data.sharding describes them): fixed-size shard files per split
(`ShardWriter`), the upload thread that hashes each, puts it and writes its sidecar (`Uploader`), and on resume
the shards a previous attempt completed (`kept_shards`)."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

import numpy as np

from lmyard.data import shards as fmt
from lmyard.layout import ShardLayout
from lmyard.paths import sha256_file
from lmyard.store import Store


class Uploader:
    """One background thread: hash a finished shard, upload it, write its sidecar, delete the local copy."""

    def __init__(self, store: Store, layout: ShardLayout):
        self.store, self.layout = store, layout
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lmyard-upload")
        self.pending: deque[Future] = deque()

    def submit(self, local: str, entry: dict, cursor: dict, address: str) -> Future:
        while len(self.pending) >= 2:  # at most 2 finished shards wait on local disk
            self.pending.popleft().result()
        fut = self.pool.submit(self._put, local, entry, cursor, address)
        self.pending.append(fut)
        return fut

    def _put(self, local: str, entry: dict, cursor: dict, address: str) -> dict:
        entry = {**entry, "bytes": os.path.getsize(local), "sha256": sha256_file(local)}
        self.store.upload(local, self.layout.file(entry["name"]))
        sidecar = {"address": address, "shard": entry, "cursor": cursor}
        self.store.write_bytes(self.layout.sidecar(entry["name"]), json.dumps(sidecar).encode())
        os.unlink(local)
        return entry

    def close(self) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


class ShardWriter:
    """Appends one split's tokens to fixed-size shard files, from the split's cursor on."""

    def __init__(
        self,
        split: str,
        shard_tokens: int,
        version: int,
        tmp: str,
        uploader: Uploader,
        address: str,
        kept: list[dict],
        cursor: dict,
    ):
        self.split, self.size, self.version = split, shard_tokens, version
        self.tmp, self.uploader, self.address = tmp, uploader, address
        self.kept = kept  # manifest entries of shards a previous attempt completed
        self.futures: list[Future] = []
        self.doc, self.skip = cursor["doc"], cursor["doc_tokens"]
        self.f: BinaryIO | None = None
        self.fill = 0
        self.last: tuple[int, int] | None = None

    @property
    def shards(self) -> int:
        return len(self.kept) + len(self.futures)

    def wants(self, i: int) -> bool:
        """Whether document i still has tokens this split must write."""
        return i >= self.doc

    def add(self, i: int, tokens: np.ndarray) -> None:
        pos = self.skip if i == self.doc else 0
        while pos < tokens.size:
            if self.f is None:
                self.path = os.path.join(self.tmp, ShardLayout.shard_name(self.split, self.shards))
                self.f = open(self.path, "wb", buffering=1 << 20)
                self.f.write(b"\0" * fmt.HEADER_BYTES)  # the header is written when the count is known
            n = min(self.size - self.fill, tokens.size - pos)
            self.f.write(tokens[pos : pos + n].tobytes())
            self.fill += n
            pos += n
            if self.fill == self.size:
                self._close(i, pos)
        self.last = (i, int(tokens.size))

    def _close(self, doc: int, doc_tokens: int) -> None:
        assert self.f is not None, "called for the open shard only"
        self.f.seek(0)
        header = np.zeros(fmt.HEADER_INTS, dtype="<i4")
        header[:3] = (fmt.MAGIC, self.version, self.fill)
        self.f.write(header.tobytes())
        self.f.close()
        entry = {"name": os.path.basename(self.path), "split": self.split, "tokens": self.fill}
        cursor = {"doc": doc, "doc_tokens": doc_tokens}
        self.futures.append(self.uploader.submit(self.path, entry, cursor, self.address))
        self.f, self.fill = None, 0

    def finish(self) -> None:
        if self.f is not None:
            assert self.last is not None, "an open shard has had a document"
            self._close(*self.last)

    def entries(self) -> list[dict]:
        return self.kept + [f.result() for f in self.futures]


def kept_shards(
    store: Store, layout: ShardLayout, split: str, address: str, log: Callable[[str], None]
) -> tuple[list[dict], dict]:
    """(entries, cursor) of the shards 0, 1, ... of a split that a previous attempt completed and that verify."""
    kept: list[dict] = []
    cursor = {"doc": -1, "doc_tokens": 0}  # -1: from the first document on
    while True:
        name = ShardLayout.shard_name(split, len(kept))
        key = layout.sidecar(name)
        if not store.exists(key):
            break
        side = json.loads(store.read_bytes(key))
        if side.get("address") != address or side["shard"]["name"] != name:
            log(f"sidecar {key} belongs to another shard set: writing {name} again")
            break
        if store.sha256(layout.file(name)) != side["shard"]["sha256"]:
            log(f"shard {name} is missing or does not match its checksum: writing it again")
            break
        kept.append(side["shard"])
        cursor = side["cursor"]
    return kept, cursor
