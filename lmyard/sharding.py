"""Tokenize-and-shard: a text source -> token shards + manifest in the store.

The shard set's address hashes what determines its bytes: the source's
fingerprint, the tokenizer's identity, the shard size, the split rule and the
format. Same inputs -> same address -> the existing set is reused.

Each document is written as <|endoftext|> followed by its tokens (llm.c's
convention), so exactly one end-of-text separates consecutive documents.
Document i goes to validation when i % data.val_every == 0, else to train.

Parallel, ordered, bounded
--------------------------
The main process reads documents in source order and cuts them into batches
of about 1 MiB of text. A pool of `data.num_proc` processes (default: every
core) tokenizes the batches, and their results are taken in submission order,
so the token stream -- and every shard byte -- is the same for any number of
processes. At most 2 batches per process are in flight, and tokens go to a
local shard file as they arrive (never a shard-sized buffer in memory), so
peak memory depends on the batch size and the process count, not on the
corpus or the shard size. A full shard is hashed and uploaded (boto3's
managed multipart transfer on S3) by a background thread while tokenizing
goes on; at most two shards wait for it, which bounds the local disk used.

Resume
------
After shard `<split>_NNNNNN.bin` is uploaded, a sidecar `<split>_NNNNNN.json`
is written next to it: the shard's manifest entry (tokens, bytes, sha256) and
the split's cursor at the shard's end -- `doc`, the index of the document
whose tokens end the shard, and `doc_tokens`, how many of that document's
tokens (its leading <|endoftext|> included) this and earlier shards hold.

A run that finds no manifest at its address looks for sidecars. For each
split it keeps the longest run of shards 0, 1, 2, ... whose sidecar exists
and whose bytes in the store hash to the sidecar's sha256; the first shard
that fails the check, and all after it, are written again. The kept shards
are not tokenized again: documents before a split's cursor are read from the
source but not sent to the tokenizer, and the cursor's document only
contributes its tokens from `doc_tokens` on. Shard numbers continue after the
kept ones. The token stream is deterministic, so the shards written after a
resume are byte-identical to those of an uninterrupted run. The manifest is
written last: without it the shard set does not exist.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lmyard import shards as fmt
from lmyard.config import RunConfig, digest
from lmyard.errors import UserError
from lmyard.paths import cache_root
from lmyard.sources import open_source
from lmyard.store import Store, open_store
from lmyard.tokenizer import get_tokenizer, identity

SPLITS = ("train", "val")
BATCH_CHARS = 1 << 20  # ~1 MiB of text per task: ~250k GPT-2 tokens, ~50 ms of one core
BATCH_DOCS = 4096  # ...or this many documents, whichever comes first
IN_FLIGHT_PER_PROC = 2  # batches queued per process: keeps every core busy, bounds memory
REPORT_EVERY_S = 5.0


@dataclass(frozen=True)
class Progress:
    """What a watcher sees: counts of this attempt and an estimate of the fraction done."""

    documents: int  # documents read from the source (kept shards' documents included)
    tokens: int  # tokens tokenized in this attempt
    shards: int  # shards complete in the store (kept + written)
    elapsed_s: float
    docs_per_s: float
    tokens_per_s: float
    fraction: float | None  # of the input's bytes read, when the source's size is known
    done: bool = False


# ---------------------------------------------------------------- tokenizer processes

_WORKER: tuple | None = None  # (encoding, dtype) of this process


def _init_worker(enc, dtype) -> None:
    global _WORKER
    _WORKER = (enc, np.dtype(dtype))


def _encode_batch(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """[<|endoftext|>, *tokens] of every text, concatenated in the shard dtype; and each one's length."""
    enc, dtype = _WORKER
    ids = [enc.encode_ordinary(t) for t in texts]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=np.uint32)
    pos = 0
    for x in ids:
        flat[pos] = enc.eot_token
        flat[pos + 1:pos + 1 + len(x)] = x
        pos += len(x) + 1
    top = np.iinfo(dtype).max
    if flat.size and int(flat.max()) > top:
        raise UserError(f"token id {int(flat.max())} does not fit the shard format's {dtype.name} "
                        f"(ids up to {top}); this tokenizer needs format version {fmt.VERSION_U32}")
    return flat.astype(dtype, copy=False), lengths


def _tokenized(batches: Iterable[tuple[list[int], list[str]]], enc, dtype, num_proc: int
               ) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    """(document indices, tokens, lengths) per batch, in input order; num_proc processes, bounded queue."""
    if num_proc == 1:
        _init_worker(enc, dtype)
        for idx, texts in batches:
            yield (idx, *_encode_batch(texts))
        return
    # spawn, not fork: the caller may hold threads (Prefect, boto3) that a forked child would inherit mid-lock.
    # A process pool executor, not multiprocessing.Pool: a tokenizer process that dies (OOM killer) fails
    # the stage with BrokenProcessPool instead of hanging it.
    with ProcessPoolExecutor(num_proc, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(enc, dtype)) as pool:
        for _ in range(num_proc):  # start the processes now, while this one opens the source
            pool.submit(int)
        pending: deque = deque()
        try:
            for idx, texts in batches:
                pending.append((idx, pool.submit(_encode_batch, texts)))
                if len(pending) >= IN_FLIGHT_PER_PROC * num_proc:
                    idx0, fut = pending.popleft()
                    yield (idx0, *fut.result())
            while pending:
                idx0, fut = pending.popleft()
                yield (idx0, *fut.result())
        finally:
            for _, fut in pending:
                fut.cancel()


# ---------------------------------------------------------------- writing shards

def _sidecar_key(prefix: str, name: str) -> str:
    return f"{prefix}/{name.removesuffix('.bin')}.json"


class _Uploader:
    """One background thread: hash a finished shard, upload it, write its sidecar, delete the local copy."""

    def __init__(self, store: Store, prefix: str):
        self.store, self.prefix = store, prefix
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lmyard-upload")
        self.pending: deque[Future] = deque()

    def submit(self, local: str, entry: dict, cursor: dict, address: str) -> Future:
        while len(self.pending) >= 2:  # at most 2 finished shards wait on local disk
            self.pending.popleft().result()
        fut = self.pool.submit(self._put, local, entry, cursor, address)
        self.pending.append(fut)
        return fut

    def _put(self, local: str, entry: dict, cursor: dict, address: str) -> dict:
        entry = {**entry, "bytes": os.path.getsize(local), "sha256": fmt.sha256_file(local)}
        self.store.upload(local, f"{self.prefix}/{entry['name']}")
        sidecar = {"address": address, "shard": entry, "cursor": cursor}
        self.store.write_bytes(_sidecar_key(self.prefix, entry["name"]), json.dumps(sidecar).encode())
        os.unlink(local)
        return entry

    def close(self) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


class _ShardWriter:
    """Appends one split's tokens to fixed-size shard files, from the split's cursor on."""

    def __init__(self, split: str, shard_tokens: int, version: int, store_prefix: str, tmp: str,
                 uploader: _Uploader, address: str, kept: list[dict], cursor: dict):
        self.split, self.size, self.version = split, shard_tokens, version
        self.tmp, self.uploader, self.address = tmp, uploader, address
        self.kept = kept  # manifest entries of shards a previous attempt completed
        self.futures: list[Future] = []
        self.doc, self.skip = cursor["doc"], cursor["doc_tokens"]
        self.f = None
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
                self.path = os.path.join(self.tmp, f"{self.split}_{self.shards:06d}.bin")
                self.f = open(self.path, "wb", buffering=1 << 20)
                self.f.write(b"\0" * fmt.HEADER_BYTES)  # the header is written when the count is known
            n = min(self.size - self.fill, tokens.size - pos)
            self.f.write(tokens[pos:pos + n].tobytes())
            self.fill += n
            pos += n
            if self.fill == self.size:
                self._close(i, pos)
        self.last = (i, int(tokens.size))

    def _close(self, doc: int, doc_tokens: int) -> None:
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
            self._close(*self.last)

    def entries(self) -> list[dict]:
        return self.kept + [f.result() for f in self.futures]


def _kept_shards(store: Store, prefix: str, split: str, address: str, log: Callable[[str], None]
                 ) -> tuple[list[dict], dict]:
    """(entries, cursor) of the shards 0, 1, ... of a split that a previous attempt completed and that verify."""
    kept: list[dict] = []
    cursor = {"doc": -1, "doc_tokens": 0}  # -1: from the first document on
    while True:
        name = f"{split}_{len(kept):06d}.bin"
        key = _sidecar_key(prefix, name)
        if not store.exists(key):
            break
        side = json.loads(store.read_bytes(key))
        if side.get("address") != address or side["shard"]["name"] != name:
            log(f"sidecar {key} belongs to another shard set: writing {name} again")
            break
        if store.sha256(f"{prefix}/{name}") != side["shard"]["sha256"]:
            log(f"shard {name} is missing or does not match its checksum: writing it again")
            break
        kept.append(side["shard"])
        cursor = side["cursor"]
    return kept, cursor


# ---------------------------------------------------------------- the stage

def plan(cfg: RunConfig, cache_dir: str):
    """(source, encoding, address, key): everything that decides the shard set, without tokenizing."""
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
        "on_decode_error": cfg.data.on_decode_error,
        "format": version,
    }
    return source, enc, digest(key), key


def default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tokenize_and_shard(cfg: RunConfig, log: Callable[[str], None] = print, cache_dir: str | None = None,
                       progress: Callable[[Progress], None] | None = None) -> tuple[fmt.ShardSet, bool]:
    """Build (or reuse, or finish) the shard set for cfg.data; returns (shard set, reused?).

    `log` gets human-readable lines (documents/s and tokens/s every few seconds);
    `progress` gets the same figures as a Progress, for a UI.
    """
    cache_dir = cache_dir or cache_root()
    store = open_store(cfg.store)
    source, enc, address, key = plan(cfg, cache_dir)
    existing = fmt.load_manifest(store, address)
    if existing is not None:
        log(f"shard set {address} already complete in {existing.uri}: reusing it, nothing to tokenize")
        if progress:
            progress(Progress(existing.manifest["documents"], 0, len(existing.manifest["shards"]), 0.0, 0.0, 0.0,
                              1.0, done=True))
        return existing, True

    prefix = fmt.shard_prefix(address)
    version, dtype = fmt.token_dtype(enc.n_vocab)
    num_proc = cfg.data.num_proc or default_num_proc()
    kept = {s: _kept_shards(store, prefix, s, address, log) for s in SPLITS}
    if any(entries for entries, _ in kept.values()):
        log(f"resuming shard set {address}: {len(kept['train'][0])} train + {len(kept['val'][0])} val shards "
            "from a previous attempt verified and kept")
    log(f"tokenizing {cfg.data.source} with {enc.name} into {store.uri(prefix)} ({num_proc} processes)")

    t0 = last = time.perf_counter()
    docs = tokens = chars = 0
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmyard-shard-", dir=cache_dir) as tmp:
        uploader = _Uploader(store, prefix)
        try:
            writers = {s: _ShardWriter(s, cfg.data.shard_tokens, version, prefix, tmp, uploader, address,
                                       kept[s][0], kept[s][1]) for s in SPLITS}

            def split_of(i: int) -> str:
                return "val" if i % cfg.data.val_every == 0 else "train"

            def batches() -> Iterator[tuple[list[int], list[str]]]:
                nonlocal docs, chars
                idx: list[int] = []
                texts: list[str] = []
                size = 0
                for i, text in enumerate(_limit(source.documents(), cfg.data.max_documents)):
                    docs, chars = i + 1, chars + len(text)
                    if not writers[split_of(i)].wants(i):
                        continue  # in a shard a previous attempt completed
                    idx.append(i)
                    texts.append(text)
                    size += len(text)
                    if size >= BATCH_CHARS or len(idx) >= BATCH_DOCS:
                        yield idx, texts
                        idx, texts, size = [], [], 0
                if idx:
                    yield idx, texts

            def report(done: bool = False) -> None:
                dt = max(time.perf_counter() - t0, 1e-9)
                frac = min(chars / source.size_bytes, 0.99) if source.size_bytes else None
                p = Progress(docs, tokens, sum(w.shards for w in writers.values()), dt, docs / dt, tokens / dt,
                             1.0 if done else frac, done)
                if not done:
                    pct = f", ~{100 * frac:.0f}% of the input" if frac is not None else ""
                    log(f"tokenized {docs:,} documents ({p.docs_per_s:,.0f} docs/s), {tokens:,} tokens "
                        f"({p.tokens_per_s:,.0f} tokens/s), {p.shards} shards{pct}")
                if progress:
                    progress(p)

            for idx, flat, lengths in _tokenized(batches(), enc, dtype, num_proc):
                ends = np.cumsum(lengths)
                for i, start, end in zip(idx, ends - lengths, ends):
                    writers[split_of(i)].add(i, flat[start:end])
                tokens += int(flat.size)
                if time.perf_counter() - last > REPORT_EVERY_S:
                    report()
                    last = time.perf_counter()
            for w in writers.values():
                w.finish()
            uploader.close()
        finally:
            uploader.pool.shutdown(wait=True, cancel_futures=True)
        entries = {s: w.entries() for s, w in writers.items()}

    if docs == 0:
        raise UserError(f"data.source {cfg.data.source!r} holds no documents: check the path, split and filters")
    counts = {s: sum(e["tokens"] for e in entries[s]) for s in SPLITS}
    for split in SPLITS:
        if counts[split] == 0:
            raise UserError(f"data.source {cfg.data.source!r} gave no {split} tokens from {docs} documents; "
                            f"add documents or lower data.val_every (now {cfg.data.val_every})")
    if source.skipped:
        log(f"warning: skipped {sum(source.skipped.values()):,} documents holding non-UTF-8 bytes "
            f"(data.on_decode_error=skip) in {len(source.skipped)} files: {', '.join(sorted(source.skipped))}")
    elapsed = time.perf_counter() - t0
    manifest = {
        "format": {"name": "llm.c-bin", "magic": fmt.MAGIC, "version": version, "dtype": np.dtype(dtype).name},
        "address": address,
        "address_key": key,
        "source": source.fingerprint,
        "tokenizer": key["tokenizer"],
        "documents": docs,
        "skipped_documents": sum(source.skipped.values()),
        "tokens": counts,
        "shards": entries["train"] + entries["val"],
        "created_s": round(elapsed, 3),
    }
    store.write_bytes(f"{prefix}/{fmt.MANIFEST}", json.dumps(manifest, indent=1).encode())
    report(done=True)
    log(f"wrote shard set {address}: {docs:,} documents, {counts['train']:,} train + {counts['val']:,} val tokens "
        f"in {elapsed:.1f}s ({tokens / max(elapsed, 1e-9):,.0f} tokens/s tokenized in this attempt)")
    return fmt.ShardSet(address=address, uri=store.uri(prefix), manifest=manifest), False


def _limit(docs: Iterator[str], n: int | None) -> Iterator[str]:
    for i, d in enumerate(docs):
        if n is not None and i >= n:
            return
        yield d
