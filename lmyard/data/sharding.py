"""Tokenize-and-shard: text sources -> token shards + manifest in the store.

The shard set's address hashes what determines its bytes: the sources'
fingerprints (and shares, for a mixture), the tokenizer's identity and its
document separators, the shard size, the split rule, the shuffle (seed
included) and the format. Same inputs -> same address -> the existing set is
reused.

Each document is written as its separators around its tokens: by default
<|endoftext|> followed by its tokens (llm.c's convention), so exactly one
end-of-text separates consecutive documents; a tokenizer.json declares its own
(tokenizer.bos before, tokenizer.eos after). Document i of the final order
goes to validation when i % data.val_every == 0, else to train.

Parallel, ordered, bounded
--------------------------
A pool of `data.num_proc` processes (default: every core) does the work in
tasks. Local and S3 files are cut into read tasks (`sources.Unit`: ~1 MiB
byte ranges of JSONL, whole small files, parquet row groups) that a process
reads, decodes and tokenizes itself; hub datasets are read by the main
process and sent in batches of about 1 MiB of text. Each source's results are
taken in submission order, so the token stream -- and every shard byte -- is
the same for any number of processes. At most 2 tasks per process and source
are in flight, and tokens go to a local shard file as they arrive (never a
shard-sized buffer in memory), so peak memory depends on the task size and
the process count, not on the corpus or the shard size. A full shard is
hashed and uploaded (boto3's managed multipart transfer on S3) by a
background thread while tokenizing goes on; at most two shards wait for it,
which bounds the local disk used.

Mixtures
--------
`data.sources` lists sources with weights or token budgets. Their documents
are interleaved one at a time: the next document comes from the source whose
tokens so far, divided by its weight, are lowest (ties: the first listed), so
every prefix of the stream holds each source's share to within a document.
With weights the mixture ends when its first source runs out; with budgets
each source gives documents until its budget is met, read again from its
start if it runs out first.

Shuffle (data.shuffle_documents)
--------------------------------
The read tasks of each file source go in a seeded order, and the mixed stream
passes a seeded shuffle buffer of data.shuffle_buffer_tokens tokens: each
document waits there and leaves at a random turn. The order depends on the
seed and the inputs only, so the shards stay reproducible; the seed is in the
address. The loader's per-epoch order of sequences (data.shuffle_sequences,
lmyard.data) is the other, independent shuffle.

Resume
------
After shard `<split>_NNNNNN.bin` is uploaded, a sidecar `<split>_NNNNNN.json`
is written next to it: the shard's manifest entry (tokens, bytes, sha256) and
the split's cursor at the shard's end -- `doc`, the index of the document
whose tokens end the shard, and `doc_tokens`, how many of that document's
tokens (its separators included) this and earlier shards hold.

A run that finds no manifest at its address looks for sidecars. For each
split it keeps the longest run of shards 0, 1, 2, ... whose sidecar exists
and whose bytes in the store hash to the sidecar's sha256; the first shard
that fails the check, and all after it, are written again. Shard numbers
continue after the kept ones. For one unshuffled `data.source` the kept shards
are not tokenized again: documents before a split's cursor are read but not
tokenized (file read tasks then run one at a time until both cursors are
passed, since a task's first document index is known only after the task
before it), and the cursor's document only contributes its tokens from
`doc_tokens` on. A mixture or a shuffled stream is tokenized again from the
start (the interleaving depends on every document's token count) and only the
kept shards' writes are skipped. The token stream is deterministic, so the
shards written after a resume are byte-identical to those of an uninterrupted
run. The manifest is written last: without it the shard set does not exist.
A source too small to give both splits tokens fails with a UserError, and the
shards it wrote are deleted first: the same inputs would fail again, so no
attempt could ever resume from them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from lmyard.config import RunConfig, digest
from lmyard.data import shards as fmt
from lmyard.data import sources as sources_mod
from lmyard.data.sources import Source, Unit, open_source, read_unit
from lmyard.data.tokenizer import get_tokenizer, identity, separators
from lmyard.errors import UserError
from lmyard.layout import ShardLayout
from lmyard.paths import cache_root
from lmyard.store import Store, open_store

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

_WORKER: tuple[Any, int | None, int | None, np.dtype] | None = None  # (encoding, bos id, eos id, dtype) here


def _init_worker(enc, bos, eos, dtype) -> None:
    global _WORKER
    _WORKER = (enc, bos, eos, np.dtype(dtype))


def _encode_batch(texts: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
    """[bos, *tokens, eos] of every text, concatenated in the shard dtype; and each one's length.

    A None text (a document a previous attempt already wrote) gets length 0 and is not tokenized.
    """
    assert _WORKER is not None, "_init_worker sets it in every tokenizer process"
    enc, bos, eos, dtype = _WORKER
    head = np.array([bos] if bos is not None else [], dtype=np.uint32)
    tail = np.array([eos] if eos is not None else [], dtype=np.uint32)
    parts, lengths = [], np.zeros(len(texts), dtype=np.int64)
    for k, text in enumerate(texts):
        if text is None:
            continue
        ids = (
            enc.encode_to_numpy(text, disallowed_special=())
            if hasattr(enc, "encode_to_numpy")  # tiktoken>=0.8
            else np.asarray(enc.encode_ordinary(text), dtype=np.uint32)
        )
        parts += [head, ids, tail]
        lengths[k] = head.size + ids.size + tail.size
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)
    top = np.iinfo(dtype).max
    if flat.size and int(flat.max()) > top:
        raise UserError(
            f"token id {int(flat.max())} does not fit the shard format's {dtype.name} "
            f"(ids up to {top}); this tokenizer needs format version {fmt.VERSION_U32}"
        )
    return flat.astype(dtype, copy=False), lengths


def _encode_unit(unit: Unit, skip: tuple | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Read one task's documents and tokenize them: (tokens, lengths, skipped documents per file).

    `skip` = (index of the task's first document, val_every, cursor doc of train, of val): documents that
    a previous attempt's kept shards hold are not tokenized (length 0).
    """
    texts, skipped = read_unit(unit)
    if skip is None:
        return (*_encode_batch(texts), skipped)
    base, val_every, train_doc, val_doc = skip
    todo = [
        None if base + k < (val_doc if (base + k) % val_every == 0 else train_doc) else t for k, t in enumerate(texts)
    ]
    return (*_encode_batch(todo), skipped)


class _Inline:
    """The pool's interface, running each task at once in this process (data.num_proc=1)."""

    def __init__(self, initargs: tuple):
        _init_worker(*initargs)

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def _start_pool(num_proc: int, initargs: tuple):
    if num_proc == 1:
        return _Inline(initargs)
    # spawn, not fork: the caller may hold threads (Prefect, boto3) that a forked child would inherit mid-lock.
    # A process pool executor, not multiprocessing.Pool: a tokenizer process that dies (OOM killer) fails
    # the stage with BrokenProcessPool instead of hanging it.
    pool = ProcessPoolExecutor(
        num_proc, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=initargs
    )
    for _ in range(num_proc):  # start the processes now, while this one fingerprints the sources
        pool.submit(int)
    return pool


class _Reader:
    """One source's tokenized documents in order; its tasks run ahead in the pool, `depth` at most."""

    def __init__(
        self,
        source: Source,
        pool,
        depth: int,
        order_seed: list[int] | None = None,
        skip: tuple | None = None,
        last_skipped: int = -1,
        limit: int | None = None,
    ):
        self.source, self.pool, self.depth, self.order_seed = source, pool, depth, order_seed
        self.limit = limit  # data.max_documents: no source needs more (a streamed one is not read further)
        self.skip, self.last_skipped = skip, last_skipped  # resume: (val_every, train doc, val doc), max of them
        self.bytes_done = 0
        self.docs: deque[np.ndarray] = deque()
        self.restart()

    def restart(self) -> None:
        self.tasks = self._unit_tasks() if self.source.units is not None else self._batch_tasks()
        self.pending: deque[tuple[Future, int]] = deque()

    def _unit_tasks(self) -> Iterator[tuple[Future, int]]:
        assert self.source.units is not None, "restart() picks unit tasks only for sources of files"
        units = self.source.units()
        if self.order_seed is not None:
            units = [units[k] for k in np.random.default_rng(self.order_seed).permutation(len(units))]
        base = 0
        for unit in units:
            if self.skip is None or base > self.last_skipped:
                yield self.pool.submit(_encode_unit, unit), unit.nbytes
                continue
            fut = self.pool.submit(_encode_unit, unit, (base, *self.skip))
            base += len(fut.result()[1])  # the next task's first document index: known once this one is read
            yield fut, unit.nbytes

    def _batch_tasks(self) -> Iterator[tuple[Future, int]]:
        texts: list[str | None] = []
        size = 0
        for i, text in enumerate(self.source.documents()):
            if self.limit is not None and i >= self.limit:
                break
            wanted = (
                self.skip is None
                or i > self.last_skipped
                or i >= (self.skip[2] if i % self.skip[0] == 0 else self.skip[1])
            )
            texts.append(text if wanted else None)
            size += len(text)
            if size >= BATCH_CHARS or len(texts) >= BATCH_DOCS:
                yield self.pool.submit(_encode_batch, texts), size
                texts, size = [], 0
        if texts:
            yield self.pool.submit(_encode_batch, texts), size

    def _fill(self) -> None:
        while len(self.pending) < self.depth and (task := next(self.tasks, None)) is not None:
            self.pending.append(task)

    def next(self) -> np.ndarray | None:
        """The next document's tokens (separators included), or None when the source is done."""
        while not self.docs:
            self._fill()
            if not self.pending:
                return None
            fut, nbytes = self.pending.popleft()
            result = fut.result()
            self._fill()
            flat, lengths = result[0], result[1]
            for name, n in (result[2] if len(result) > 2 else {}).items():
                self.source.skipped[name] = self.source.skipped.get(name, 0) + n
            self.bytes_done += nbytes
            self.docs.extend(np.split(flat, np.cumsum(lengths)[:-1]) if lengths.size else [])
        return self.docs.popleft()

    def close(self) -> None:
        for fut, _ in self.pending:
            fut.cancel()


def _mixed(
    readers: list[_Reader], weights: list[float], budgets: list[int] | None, counts: list[list[int]]
) -> Iterator[np.ndarray]:
    """Documents of the sources interleaved by token share; counts[k] = [documents, tokens] of source k."""
    active = list(range(len(readers)))
    while active:
        k = min(active, key=lambda j: (counts[j][1] / weights[j], j))
        doc = readers[k].next()
        if doc is None:
            if budgets is None:
                return  # weights (or one plain source): the stream ends with its first exhausted source
            if counts[k][0] == 0:
                raise UserError(f"data.sources[{k}] holds no documents: check its path, split and filters")
            readers[k].restart()  # a budget larger than the source: read it again
            continue
        counts[k][0] += 1
        counts[k][1] += int(doc.size)
        yield doc
        if budgets is not None and counts[k][1] >= budgets[k]:
            active.remove(k)


def _shuffled(docs: Iterator[np.ndarray], seed: int, buffer_tokens: int) -> Iterator[np.ndarray]:
    """A seeded shuffle buffer: each document waits among ~buffer_tokens tokens and leaves at a random turn."""
    rng = np.random.default_rng([seed, 1])
    buf: list[np.ndarray] = []
    held = 0
    for doc in docs:
        buf.append(doc.copy())  # a copy: a view would hold its whole task's array in memory
        held += doc.size
        while held > buffer_tokens and buf:
            k = int(rng.integers(len(buf)))
            buf[k], buf[-1] = buf[-1], buf[k]
            out = buf.pop()
            held -= out.size
            yield out
    for k in rng.permutation(len(buf)):
        yield buf[k]


# ---------------------------------------------------------------- writing shards


class _Uploader:
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
        entry = {**entry, "bytes": os.path.getsize(local), "sha256": fmt.sha256_file(local)}
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


class _ShardWriter:
    """Appends one split's tokens to fixed-size shard files, from the split's cursor on."""

    def __init__(
        self,
        split: str,
        shard_tokens: int,
        version: int,
        tmp: str,
        uploader: _Uploader,
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


def _kept_shards(
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


# ---------------------------------------------------------------- the stage


def _address_key(cfg: RunConfig, sources: list[Source], enc) -> dict:
    """What decides the shard set's bytes. One unshuffled source keeps the key of earlier lmyard versions."""
    d = cfg.data
    version, _ = fmt.token_dtype(enc.n_vocab)
    key = {
        "tokenizer": identity(enc, cfg.tokenizer),
        "shard_tokens": d.shard_tokens,
        "split": {"rule": "doc_index_mod", "val_every": d.val_every},
        "max_documents": d.max_documents,
        "on_decode_error": d.on_decode_error,
        "format": version,
    }
    if d.sources is None:
        key.update(source=sources[0].fingerprint, text_field=d.text_field)
    else:
        weights, budgets = d.shares()
        key["mixture"] = {
            "rule": "lowest_tokens_over_weight",
            "stop": "budgets" if budgets else "first_exhausted",
            "sources": [
                {"source": src.fingerprint, "text_field": c.text_field, "share": w}
                for src, c, w in zip(sources, d.source_configs(), weights)
            ],
        }
    if d.shuffle_documents:
        key["shuffle"] = {
            "seed": d.shuffle_seed,
            "buffer_tokens": d.shuffle_buffer_tokens,
            "unit_bytes": sources_mod.UNIT_BYTES,
        }
    return key


def plan(cfg: RunConfig, cache_dir: str):
    """(sources, encoding, address, key): everything that decides the shard set, without tokenizing."""
    enc = get_tokenizer(cfg.tokenizer)
    sources = [open_source(c, cache_dir) for c in cfg.data.source_configs()]
    key = _address_key(cfg, sources, enc)
    return sources, enc, digest(key), key


def default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _describe(cfg: RunConfig) -> str:
    if cfg.data.sources is None:
        return f"data.source {cfg.data.source!r}"
    return "data.sources " + ", ".join(repr(s.source) for s in cfg.data.sources)


def tokenize_and_shard(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    cache_dir: str | None = None,
    progress: Callable[[Progress], None] | None = None,
    start_pool: Callable[[int, tuple], Any] | None = None,
) -> tuple[fmt.ShardSet, bool]:
    """Build (or reuse, or finish) the shard set for cfg.data; returns (shard set, reused?). `log` gets lines
    for people (documents/s and tokens/s every few seconds), `progress` the same figures as a Progress, for a UI;
    `start_pool(num_proc, initargs)`, the read tasks' pool (default: processes here; lmyard.data.raypool).
    """
    cache_dir = cache_dir or cache_root()
    store = open_store(cfg.store)
    store.check_writable()  # before any tokenizing: the shards and every checkpoint go there
    enc = get_tokenizer(cfg.tokenizer)
    version, dtype = fmt.token_dtype(enc.n_vocab)
    num_proc = cfg.data.num_proc or default_num_proc()
    pool = (start_pool or _start_pool)(num_proc, (enc, *separators(enc, cfg.tokenizer), dtype))  # starts now
    try:
        sources, enc, address, key = plan(cfg, cache_dir)
        existing = fmt.load_manifest(store, address)
        if existing is not None:
            log(f"shard set {address} already complete in {existing.uri}: reusing it, nothing to tokenize")
            if progress:
                progress(
                    Progress(
                        existing.manifest["documents"],
                        0,
                        len(existing.manifest["shards"]),
                        0.0,
                        0.0,
                        0.0,
                        1.0,
                        done=True,
                    )
                )
            return existing, True
        return _build(cfg, store, pool, num_proc, sources, enc, address, key, log, cache_dir, progress), False
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _build(
    cfg: RunConfig,
    store: Store,
    pool,
    num_proc: int,
    sources: list[Source],
    enc,
    address: str,
    key: dict,
    log,
    cache_dir: str,
    progress,
) -> fmt.ShardSet:
    d = cfg.data
    layout = ShardLayout(address)
    version, dtype = fmt.token_dtype(enc.n_vocab)
    kept = {s: _kept_shards(store, layout, s, address, log) for s in SPLITS}
    if any(entries for entries, _ in kept.values()):
        log(
            f"resuming shard set {address}: {len(kept['train'][0])} train + {len(kept['val'][0])} val shards "
            "from a previous attempt verified and kept"
        )
    log(f"tokenizing {_describe(cfg)} with {enc.name} into {store.uri(layout.root)} ({num_proc} processes)")
    counts = [[0, 0] for _ in sources]
    stats = {"docs": 0, "tokens": 0, "t0": time.perf_counter()}
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmyard-shard-", dir=cache_dir) as tmp:
        uploader = _Uploader(store, layout)
        readers = _readers(cfg, sources, pool, num_proc, kept)
        try:
            writers = {
                s: _ShardWriter(s, d.shard_tokens, version, tmp, uploader, address, kept[s][0], kept[s][1])
                for s in SPLITS
            }
            report = _reporter(sources, readers, writers, stats, log, progress)
            stream = _mixed(readers, *d.shares(), counts)
            if d.shuffle_documents:
                stream = _shuffled(stream, d.shuffle_seed, d.shuffle_buffer_tokens)
            _write(stream, writers, d, stats, report)
            uploader.close()
        finally:
            for r in readers:
                r.close()
            uploader.pool.shutdown(wait=True, cancel_futures=True)
        entries = {s: w.entries() for s, w in writers.items()}
    return _finish(cfg, store, layout, sources, address, key, version, dtype, entries, counts, stats, log, report)


def _readers(cfg: RunConfig, sources: list[Source], pool, num_proc: int, kept: dict) -> list[_Reader]:
    """One reader per source; for data.source unshuffled, told which documents the kept shards hold."""
    d = cfg.data
    depth = IN_FLIGHT_PER_PROC * num_proc
    skip, last = None, -1
    if d.sources is None and not d.shuffle_documents:  # document i of the stream is document i of the source
        train_doc, val_doc = kept["train"][1]["doc"], kept["val"][1]["doc"]
        if max(train_doc, val_doc) >= 0:
            skip, last = (d.val_every, train_doc, val_doc), max(train_doc, val_doc)
    return [
        _Reader(
            src,
            pool,
            depth,
            order_seed=[d.shuffle_seed, 0, k] if d.shuffle_documents else None,
            skip=skip,
            last_skipped=last,
            limit=d.max_documents,
        )
        for k, src in enumerate(sources)
    ]


def _write(stream: Iterator[np.ndarray], writers: dict, d, stats: dict, report) -> None:
    last = time.perf_counter()
    for i, doc in enumerate(stream):
        if d.max_documents is not None and i >= d.max_documents:
            break
        stats["docs"] = i + 1
        writer = writers["val" if i % d.val_every == 0 else "train"]
        if writer.wants(i):
            writer.add(i, doc)
        stats["tokens"] += int(doc.size)
        if time.perf_counter() - last > REPORT_EVERY_S:
            report()
            last = time.perf_counter()
    for w in writers.values():
        w.finish()


def _reporter(sources, readers, writers, stats, log, progress):
    total = sum(s.size_bytes or 0 for s in sources) if all(s.size_bytes for s in sources) else None

    def report(done: bool = False) -> None:
        dt = max(time.perf_counter() - stats["t0"], 1e-9)
        docs, tokens = stats["docs"], stats["tokens"]
        frac = min(sum(r.bytes_done for r in readers) / total, 0.99) if total else None
        p = Progress(
            docs,
            tokens,
            sum(w.shards for w in writers.values()),
            dt,
            docs / dt,
            tokens / dt,
            1.0 if done else frac,
            done,
        )
        if not done:
            pct = f", ~{100 * frac:.0f}% of the input" if frac is not None else ""
            log(
                f"tokenized {docs:,} documents ({p.docs_per_s:,.0f} docs/s), {tokens:,} tokens "
                f"({p.tokens_per_s:,.0f} tokens/s), {p.shards} shards{pct}"
            )
        if progress:
            progress(p)

    return report


def _finish(cfg, store, layout, sources, address, key, version, dtype, entries, counts, stats, log, report):
    docs = stats["docs"]
    if docs == 0:
        raise UserError(f"{_describe(cfg)} holds no documents: check the path, split and filters")
    tokens = {s: sum(e["tokens"] for e in entries[s]) for s in SPLITS}
    for split in SPLITS:
        if tokens[split] == 0:
            # the same inputs always end here: the other split's shards (and sidecars) could never make a set
            store.delete(layout.root)
            raise UserError(
                f"{_describe(cfg)} gave no {split} tokens from {docs} documents; "
                f"add documents or lower data.val_every (now {cfg.data.val_every})"
            )
    if lopsided := fmt.lopsided_split(tokens, cfg.data.val_every):
        log(lopsided)
    skipped = {k: v for s in sources for k, v in s.skipped.items()}
    if skipped:
        log(
            f"warning: skipped {sum(skipped.values()):,} documents holding non-UTF-8 bytes "
            f"(data.on_decode_error=skip) in {len(skipped)} files: {', '.join(sorted(skipped))}"
        )
    elapsed = time.perf_counter() - stats["t0"]
    manifest = {
        "format": {"name": "llm.c-bin", "magic": fmt.MAGIC, "version": version, "dtype": np.dtype(dtype).name},
        "address": address,
        "address_key": key,
        "source": sources[0].fingerprint if len(sources) == 1 else [s.fingerprint for s in sources],
        "tokenizer": key["tokenizer"],
        "documents": docs,
        "skipped_documents": sum(skipped.values()),
        "tokens": tokens,
        "shards": entries["train"] + entries["val"],
        "created_s": round(elapsed, 3),
    }
    if cfg.data.sources is not None:
        manifest["mixture"] = [
            {"source": c.source, "documents": n, "tokens": t} for c, (n, t) in zip(cfg.data.sources, counts)
        ]
        log(
            "mixture: "
            + ", ".join(
                f"{m['source']} {m['tokens']:,} tokens ({100 * m['tokens'] / max(sum(t for _, t in counts), 1):.1f}%)"
                for m in manifest["mixture"]
            )
        )
    store.write_bytes(layout.manifest, json.dumps(manifest, indent=1).encode())
    report(done=True)
    log(
        f"wrote shard set {address}: {docs:,} documents, {tokens['train']:,} train + {tokens['val']:,} val tokens "
        f"in {elapsed:.1f}s ({stats['tokens'] / max(elapsed, 1e-9):,.0f} tokens/s tokenized in this attempt)"
    )
    return fmt.ShardSet(address=address, uri=store.uri(layout.root), manifest=manifest)
