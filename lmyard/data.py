"""Memory-mapped token data with a global cursor.

The train split is one stream: its shards concatenated in manifest order.
It is cut into sequences of T+1 tokens that overlap by one token (inputs
s[:-1], targets s[1:]); global sequence k starts at token (k mod n) * T,
where n sequences fit the stream, so the stream repeats after n.

Every optimizer step takes the next N = batch_tokens / T global sequences.
Micro-step m on rank r of W reads sequences m*W*B + r*B ... + B of them.
The cursor (global sequences consumed) is the whole data state: the token
order does not depend on the world size, and resuming is exact.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from lmyard.errors import UserError
from lmyard.shards import ShardSet, read_shard
from lmyard.store import fetch_to_cache, open_store


class TokenStream:
    """Shards concatenated into one random-access array of tokens."""

    def __init__(self, paths: list[str]):
        self.arrays = [read_shard(p) for p in paths]
        self.starts = np.cumsum([0] + [a.size for a in self.arrays])
        self.total = int(self.starts[-1])

    def read(self, start: int, n: int) -> np.ndarray:
        assert 0 <= start and start + n <= self.total, (start, n, self.total)
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos, filled = start - int(self.starts[i]), 0
        while filled < n:
            take = min(n - filled, self.arrays[i].size - pos)
            out[filled:filled + take] = self.arrays[i][pos:pos + take]
            filled, i, pos = filled + take, i + 1, 0
        return out


def local_shards(shards: ShardSet, store_uri: str, split: str, cache_dir: str) -> list[str]:
    """Local paths of a split's shards: the store's own files, or downloads in the node-local cache."""
    store = open_store(store_uri)
    prefix = f"shards/{shards.address}"
    return [fetch_to_cache(store, f"{prefix}/{f['name']}", cache_dir) for f in shards.files(split)]


class TrainBatches:
    def __init__(self, stream: TokenStream, seq_len: int, micro_batch: int, accum: int, rank: int, world: int):
        self.stream, self.T, self.B = stream, seq_len, micro_batch
        self.accum, self.rank, self.world = accum, rank, world
        self.n_seq = (stream.total - 1) // seq_len
        if self.n_seq < 1:
            raise UserError(f"the train split holds {stream.total} tokens, fewer than one sequence of {seq_len + 1}")
        self.per_step = accum * world * micro_batch  # global sequences per optimizer step

    def sequences(self, first: int, count: int) -> np.ndarray:
        """`count` global sequences from index `first`, as a (count, T+1) array."""
        rows = np.empty((count, self.T + 1), dtype=np.int64)
        for j in range(count):
            rows[j] = self.stream.read(((first + j) % self.n_seq) * self.T, self.T + 1)
        return rows

    def micro_batch(self, cursor: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for one rank's micro-step of the step that starts at `cursor`."""
        first = cursor + micro * self.world * self.B + self.rank * self.B
        rows = torch.from_numpy(self.sequences(first, self.B))
        return rows[:, :-1], rows[:, 1:]


def val_sequences(stream: TokenStream, seq_len: int, max_tokens: int) -> torch.Tensor:
    """The fixed validation set: consecutive sequences from the start of the val split, (n, T+1)."""
    n = min(max_tokens // seq_len, (stream.total - 1) // seq_len)
    if n < 1:
        raise UserError(f"the val split holds {stream.total} tokens, fewer than one sequence of {seq_len + 1}; "
                        "lower data.val_every or model.block_size")
    return torch.stack([torch.from_numpy(stream.read(i * seq_len, seq_len + 1)) for i in range(n)])


def default_cache_dir() -> str:
    return os.environ.get("LMYARD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lmyard"))
