"""Tokenize-and-shard: a text source -> token shards + manifest in the store.

The shard set's address hashes what determines its bytes: the source's
fingerprint, the tokenizer's identity, the shard size, the split rule and the
format. Same inputs -> same address -> the existing set is reused.

Each document is written as <|endoftext|> followed by its tokens (llm.c's
convention), so exactly one end-of-text separates consecutive documents.
Document i goes to validation when i % data.val_every == 0, else to train.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

from lmyard import shards as fmt
from lmyard.config import RunConfig, digest
from lmyard.errors import UserError
from lmyard.sources import open_source
from lmyard.store import Store, open_store
from lmyard.tokenizer import get_tokenizer, identity

SPLITS = ("train", "val")
BATCH_DOCS = 256


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class _ShardWriter:
    """Fills fixed-size shards of one split; uploads each as soon as it is full."""

    def __init__(self, split: str, shard_tokens: int, version: int, dtype, store: Store, prefix: str, tmp: str):
        self.split, self.size, self.version = split, shard_tokens, version
        self.store, self.prefix, self.tmp = store, prefix, tmp
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self.fill = 0
        self.written: list[dict] = []

    def add(self, tokens: list[int]) -> None:
        arr = np.asarray(tokens, dtype=np.int64)
        top = np.iinfo(self.buf.dtype).max
        if arr.size and int(arr.max()) > top:
            raise UserError(f"token id {int(arr.max())} does not fit shard format version {self.version}")
        pos = 0
        while pos < arr.size:
            n = min(self.size - self.fill, arr.size - pos)
            self.buf[self.fill:self.fill + n] = arr[pos:pos + n]
            self.fill += n
            pos += n
            if self.fill == self.size:
                self.flush()

    def flush(self) -> None:
        if self.fill == 0:
            return
        name = f"{self.split}_{len(self.written):06d}.bin"
        local = os.path.join(self.tmp, name)
        fmt.write_shard(local, self.buf[:self.fill], self.version)
        self.store.upload(local, f"{self.prefix}/{name}")
        self.written.append({"name": name, "split": self.split, "tokens": int(self.fill),
                             "bytes": os.path.getsize(local), "sha256": fmt.sha256_file(local)})
        os.unlink(local)
        self.fill = 0


def plan(cfg: RunConfig, cache_dir: str):
    """(source, encoding, address): everything that decides the shard set, without tokenizing."""
    source = open_source(cfg.data, cache_dir)
    enc = get_tokenizer(cfg.tokenizer)
    version, _ = fmt.token_dtype(enc.n_vocab)
    key = {
        "source": source.fingerprint,
        "tokenizer": identity(enc),
        "shard_tokens": cfg.data.shard_tokens,
        "split": {"rule": "doc_index_mod", "val_every": cfg.data.val_every},
        "max_documents": cfg.data.max_documents,
        "text_field": cfg.data.text_field,
        "format": version,
    }
    return source, enc, digest(key), key


def tokenize_and_shard(cfg: RunConfig, log: Callable[[str], None] = print,
                       cache_dir: str | None = None) -> tuple[fmt.ShardSet, bool]:
    """Build (or reuse) the shard set for cfg.data; returns (shard set, reused?)."""
    cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "lmyard-cache")
    store = open_store(cfg.store)
    source, enc, address, key = plan(cfg, cache_dir)
    existing = fmt.load_manifest(store, address)
    if existing is not None:
        log(f"shard set {address} already complete in {existing.uri}: reusing it, nothing to tokenize")
        return existing, True

    prefix = fmt.shard_prefix(address)
    version, dtype = fmt.token_dtype(enc.n_vocab)
    eot = enc.eot_token
    threads = os.cpu_count() or 1
    log(f"tokenizing {cfg.data.source} with {enc.name} into {store.uri(prefix)} ({threads} threads)")
    t0 = last = time.perf_counter()
    docs = tokens = 0
    with tempfile.TemporaryDirectory(prefix="lmyard-shard-") as tmp:
        writers = {s: _ShardWriter(s, cfg.data.shard_tokens, version, dtype, store, prefix, tmp) for s in SPLITS}
        for batch in _batches(_limit(source.documents(), cfg.data.max_documents), BATCH_DOCS):
            for text, ids in zip(batch, enc.encode_ordinary_batch(batch, num_threads=threads)):
                split = "val" if docs % cfg.data.val_every == 0 else "train"
                writers[split].add([eot, *ids])
                docs += 1
                tokens += len(ids) + 1
            now = time.perf_counter()
            if now - last > 5:
                log(f"tokenized {docs:,} documents, {tokens:,} tokens ({tokens / (now - t0):,.0f} tokens/s)")
                last = now
        for w in writers.values():
            w.flush()
        if docs == 0:
            raise UserError(f"data.source {cfg.data.source!r} holds no documents: check the path, split and filters")
        counts = {s: sum(f["tokens"] for f in w.written) for s, w in writers.items()}
        for split in SPLITS:
            if counts[split] == 0:
                raise UserError(f"data.source {cfg.data.source!r} gave no {split} tokens from {docs} documents; "
                                f"add documents or lower data.val_every (now {cfg.data.val_every})")
    elapsed = time.perf_counter() - t0
    manifest = {
        "format": {"name": "llm.c-bin", "magic": fmt.MAGIC, "version": version, "dtype": np.dtype(dtype).name},
        "address": address,
        "address_key": key,
        "source": source.fingerprint,
        "tokenizer": key["tokenizer"],
        "documents": docs,
        "tokens": counts,
        "shards": writers["train"].written + writers["val"].written,
        "created_s": round(elapsed, 3),
    }
    store.write_bytes(f"{prefix}/{fmt.MANIFEST}", json.dumps(manifest, indent=1).encode())
    log(f"wrote shard set {address}: {docs:,} documents, {counts['train']:,} train + {counts['val']:,} val tokens "
        f"in {elapsed:.1f}s ({tokens / max(elapsed, 1e-9):,.0f} tokens/s)")
    return fmt.ShardSet(address=address, uri=store.uri(prefix), manifest=manifest), False


def _limit(docs: Iterator[str], n: int | None) -> Iterator[str]:
    for i, d in enumerate(docs):
        if n is not None and i >= n:
            return
        yield d
