"""Memory-mapped token data with a global cursor.

The train split is one stream: its shards concatenated in manifest order.
It is cut into sequences of T+1 tokens that overlap by one token (inputs
s[:-1], targets s[1:]); global sequence k starts at token (k mod n) * T,
where n sequences fit the stream, so the stream repeats after n.

Design notes: docs/data.md, `lmyard/data/loader.py`.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from lmyard.data.shards import ShardSet, read_header, read_shard
from lmyard.errors import UserError
from lmyard.layout import ShardLayout
from lmyard.paths import cache_root, confined, sha256_file
from lmyard.store import open_store


class ShardFiles:
    """Local paths of one split's shards; fetching shard i starts the fetch of shard i+1."""

    def __init__(self, shards: ShardSet, store_uri: str, split: str, cache_dir: str):
        self.store = open_store(store_uri)
        self.files = shards.files(split)
        self.layout = ShardLayout(shards.address)
        self.cache_dir = cache_dir
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-fetch")
        self.futures: dict[int, Future] = {}
        self.lock = threading.Lock()

    @property
    def sizes(self) -> list[int]:
        return [f["tokens"] for f in self.files]

    def _fetch(self, i: int) -> str:
        meta = self.files[i]
        key = self.layout.file(meta["name"])
        direct = self.store.local_path(key)
        if direct is not None:
            return direct
        dest = confined(self.cache_dir, key, "shard")  # names come from the manifest in the store
        if not (os.path.exists(dest) and os.path.getsize(dest) == meta["bytes"]):
            self.store.download(key, dest)
            if sha256_file(dest) != meta["sha256"]:
                os.unlink(dest)
                raise OSError(f"{self.store.uri(key)} does not match its manifest checksum")
        return dest

    def _future(self, i: int) -> Future:
        with self.lock:
            if i not in self.futures:
                self.futures[i] = self.pool.submit(self._fetch, i)
            return self.futures[i]

    def path(self, i: int) -> str:
        fut = self._future(i)
        if i + 1 < len(self.files):
            self._future(i + 1)
        return fut.result()


class TokenStream:
    """Shards concatenated into one random-access array of tokens, opened lazily."""

    def __init__(self, files: ShardFiles | list[str]):
        if isinstance(files, ShardFiles):
            sizes, self._path = files.sizes, files.path
        else:
            paths = list(files)
            sizes, self._path = [read_header(p)[1] for p in paths], lambda i: paths[i]
        self.arrays: dict[int, np.ndarray] = {}
        self.starts = np.cumsum([0, *sizes])
        self.total = int(self.starts[-1])

    def _array(self, i: int) -> np.ndarray:
        if i not in self.arrays:
            self.arrays[i] = read_shard(self._path(i))
        return self.arrays[i]

    def read(self, start: int, n: int) -> np.ndarray:
        assert 0 <= start and start + n <= self.total, (start, n, self.total)
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos, filled = start - int(self.starts[i]), 0
        while filled < n:
            arr = self._array(i)
            take = min(n - filled, arr.size - pos)
            out[filled : filled + take] = arr[pos : pos + take]
            filled, i, pos = filled + take, i + 1, 0
        return out


_M64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


EXPLICIT_MAX = 1 << 22  # sequences up to which an epoch's permutation is an array (4 bytes each)


@functools.lru_cache(maxsize=2)
def _explicit(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int32)


def permute(index: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """P(index): a pseudo-random permutation of 0..n-1 chosen by (seed, epoch); vectorized."""
    if n <= EXPLICIT_MAX:
        return _explicit(n, seed, epoch)[np.asarray(index, dtype=np.int64)].astype(np.int64)
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [
        np.uint64(int(_mix64(np.array([(seed * 0x9E3779B97F4A7C15 + epoch * 8 + r + 1) & _M64], dtype=np.uint64))[0]))
        for r in range(6)
    ]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(np.asarray(index, dtype=np.uint64))
    while (over := out >= n).any():  # cycle-walking: a permutation of the 4**half domain, walked back into 0..n-1
        out[over] = feistel(out[over])
    return out.astype(np.int64)


class TrainBatches:
    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        micro_batch: int,
        accum: int,
        rank: int,
        world: int,
        *,
        shuffle_seed: int | None = None,
    ):
        self.stream, self.T, self.B = stream, seq_len, micro_batch
        self.accum, self.rank, self.world = accum, rank, world
        self.shuffle_seed = shuffle_seed  # None: sequences in stream order, epoch after epoch
        self.n_seq = (stream.total - 1) // seq_len
        if self.n_seq < 1:
            raise UserError(f"the train split holds {stream.total} tokens, fewer than one sequence of {seq_len + 1}")
        self.per_step = accum * world * micro_batch  # global sequences per optimizer step

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens (inputs) of one pass over the train split's sequences."""
        return self.n_seq * self.T

    def epoch(self, cursor: int) -> float:
        """Epochs of the train split consumed at this cursor (global sequences read / sequences per epoch)."""
        return cursor / self.n_seq

    def repeat_warning(self, max_steps: int) -> str | None:
        """The once-only warning when max_steps reads the train split more than once; None when it does not."""
        planned = max_steps * self.per_step
        if planned <= self.n_seq:
            return None
        first = -(-self.n_seq // self.per_step)  # the first step that reads a sequence a second time (1-based)
        return (
            f"warning: train.max_steps={max_steps} reads {planned * self.T:,} tokens, "
            f"{planned / self.n_seq:.2f} epochs of the train split ({self.tokens_per_epoch:,} tokens in "
            f"{self.n_seq:,} sequences of {self.T}): data repeats from step {first} on. Add data or lower "
            "train.max_steps if that is not meant"
        )

    def order(self, first: int, count: int) -> np.ndarray:
        """Stream positions (sequence indices within an epoch) of global sequences first .. first+count-1."""
        k = np.arange(first, first + count, dtype=np.int64)
        epochs, pos = np.divmod(k, self.n_seq)
        if self.shuffle_seed is None:
            return pos
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = permute(pos[sel], self.n_seq, self.shuffle_seed, int(e))
        return out

    def sequences(self, first: int, count: int) -> np.ndarray:
        """`count` global sequences from index `first`, as a (count, T+1) array."""
        rows = np.empty((count, self.T + 1), dtype=np.int64)
        for j, s in enumerate(self.order(first, count)):
            rows[j] = self.stream.read(int(s) * self.T, self.T + 1)
        return rows

    def micro_batch(self, cursor: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for one rank's micro-step of the step that starts at `cursor`."""
        first = cursor + micro * self.world * self.B + self.rank * self.B
        rows = torch.from_numpy(self.sequences(first, self.B))
        return rows[:, :-1], rows[:, 1:]


class Prefetcher:
    """Builds this rank's micro-batches ahead of use in a background thread (pinned memory on CUDA).

    `get()` returns the next (inputs, targets) on the device, in order: step by step
    from `cursor`, micro-step by micro-step. `waited_s` adds up the time `get()`
    blocked because the next batch was not ready.
    """

    def __init__(self, batches: TrainBatches, cursor: int, device: torch.device, depth: int = 4):
        self.batches, self.device, self.depth = batches, device, depth
        self.pin = device.type == "cuda"
        self.waited_s = 0.0
        self._start(cursor)

    def _start(self, cursor: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._produce, args=(cursor, self.queue, self.stop), daemon=True, name="batch-prefetch"
        )
        self.thread.start()

    def _produce(self, cursor: int, q: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                for micro in range(self.batches.accum):
                    x, y = self.batches.micro_batch(cursor, micro)
                    if self.pin:
                        x, y = x.pin_memory(), y.pin_memory()
                    while not stop.is_set():
                        try:
                            q.put((x, y), timeout=0.1)
                            break
                        except queue.Full:
                            continue
                cursor += self.batches.per_step
        except BaseException as e:
            q.put(e)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        item = self.queue.get()
        self.waited_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        x, y = item
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def reset(self, cursor: int) -> None:
        """Drop what was built ahead and continue from `cursor` (after a rollback)."""
        self.close()
        self._start(cursor)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def val_sequences(stream: TokenStream, seq_len: int, max_tokens: int) -> torch.Tensor:
    """The fixed validation set: consecutive sequences from the start of the val split, (n, T+1)."""
    n = min(max_tokens // seq_len, (stream.total - 1) // seq_len)
    if n < 1:
        raise UserError(
            f"the val split holds {stream.total} tokens, fewer than one sequence of {seq_len + 1}; "
            "lower data.val_every or model.block_size"
        )
    return torch.stack([torch.from_numpy(stream.read(i * seq_len, seq_len + 1)) for i in range(n)])


def split_stream(shards: ShardSet, store_uri: str, split: str, cache_dir: str) -> TokenStream:
    return TokenStream(ShardFiles(shards, store_uri, split, cache_dir))


def default_cache_dir() -> str:
    """The node-local cache root (LMYARD_CACHE, default ~/.cache/lmyard): see lmyard.paths.cache_root."""
    return cache_root()
