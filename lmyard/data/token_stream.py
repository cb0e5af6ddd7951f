"""The token stream of tokenize-and-shard (lmyard.data.sharding describes it): tokenizer processes, each
source's documents read and tokenized in order (`Reader`), the mixture of sources (`mixed`) and the seeded shuffle
buffer (`shuffled`)."""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np

from lmyard.data import shards as fmt
from lmyard.data.sources import Source, Unit, read_unit
from lmyard.errors import UserError

BATCH_CHARS = 1 << 20  # ~1 MiB of text per task: ~250k GPT-2 tokens, ~50 ms of one core
BATCH_DOCS = 4096  # ...or this many documents, whichever comes first


_WORKER: tuple[Any, int | None, int | None, np.dtype] | None = None  # (encoding, bos id, eos id, dtype) here


def init_worker(enc, bos, eos, dtype) -> None:
    global _WORKER
    _WORKER = (enc, bos, eos, np.dtype(dtype))


def encode_batch(texts: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
    """[bos, *tokens, eos] of every text, concatenated in the shard dtype; and each one's length.

    A None text (a document a previous attempt already wrote) gets length 0 and is not tokenized.
    """
    assert _WORKER is not None, "init_worker sets it in every tokenizer process"
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
        return (*encode_batch(texts), skipped)
    base, val_every, train_doc, val_doc = skip
    todo = [
        None if base + k < (val_doc if (base + k) % val_every == 0 else train_doc) else t for k, t in enumerate(texts)
    ]
    return (*encode_batch(todo), skipped)


class _Inline:
    """The pool's interface, running each task at once in this process (data.num_proc=1)."""

    def __init__(self, initargs: tuple):
        init_worker(*initargs)

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def start_pool(num_proc: int, initargs: tuple):
    if num_proc == 1:
        return _Inline(initargs)
    # spawn, not fork: the caller may hold threads (Prefect, boto3) that a forked child would inherit mid-lock.
    # A process pool executor, not multiprocessing.Pool: a tokenizer process that dies (OOM killer) fails
    # the stage with BrokenProcessPool instead of hanging it.
    pool = ProcessPoolExecutor(num_proc, mp_context=mp.get_context("spawn"), initializer=init_worker, initargs=initargs)
    for _ in range(num_proc):  # start the processes now, while this one fingerprints the sources
        pool.submit(int)
    return pool


class Reader:
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
                yield self.pool.submit(encode_batch, texts), size
                texts, size = [], 0
        if texts:
            yield self.pool.submit(encode_batch, texts), size

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


def mixed(
    readers: list[Reader], weights: list[float], budgets: list[int] | None, counts: list[list[int]]
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


def shuffled(docs: Iterator[np.ndarray], seed: int, buffer_tokens: int) -> Iterator[np.ndarray]:
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
