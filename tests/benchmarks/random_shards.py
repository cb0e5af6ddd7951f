"""A shard set of uniformly random GPT-2 token ids for the GPU benchmarks (no corpus, no `datasets`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lmyard.data import shards as fmt
from lmyard.paths import sha256_file


def make_shards(store: Path, tokens: int) -> dict:
    """A shard set of uniformly random GPT-2 token ids, written straight in the store layout."""
    rng = np.random.default_rng(0)
    address = "bench-random-r50k"
    prefix = store / "shards" / address
    prefix.mkdir(parents=True, exist_ok=True)
    files = []
    for split, n in (("train", tokens), ("val", 1 << 20)):
        path = prefix / f"{split}_000000.bin"
        fmt.write_shard(path, rng.integers(0, 50257, n, dtype=np.int64), fmt.VERSION_U16)
        files.append(
            {
                "name": path.name,
                "split": split,
                "tokens": n,
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
        )
    manifest = {"address": address, "tokenizer": {"name": "r50k_base", "n_vocab": 50257, "eot": 50256}, "shards": files}
    (prefix / "manifest.json").write_text(json.dumps(manifest))
    return {"address": address, "uri": str(prefix), "manifest": manifest}
