"""A shard set of uniformly random token ids for the GPU benchmarks (no corpus, no `datasets`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lmyard.data import shards as fmt
from lmyard.paths import sha256_file

TOKENIZERS = {
    "r50k_base": {"name": "r50k_base", "n_vocab": 50257, "eot": 50256},
    "bytes": {"name": "bytes", "n_vocab": 257, "eot": 256},
}


def make_shards(store: Path, tokens: int, tokenizer: str = "r50k_base") -> dict:
    """A shard set of uniformly random token ids of `tokenizer` (GPT-2's, or lmyard's `bytes`), written straight
    in the store layout."""
    rng = np.random.default_rng(0)
    vocab = TOKENIZERS[tokenizer]
    address = "bench-random-r50k" if tokenizer == "r50k_base" else f"bench-random-{tokenizer}"
    prefix = store / "shards" / address
    prefix.mkdir(parents=True, exist_ok=True)
    files = []
    for split, n in (("train", tokens), ("val", 1 << 20)):
        path = prefix / f"{split}_000000.bin"
        fmt.write_shard(path, rng.integers(0, vocab["n_vocab"], n, dtype=np.int64), fmt.VERSION_U16)
        files.append(
            {
                "name": path.name,
                "split": split,
                "tokens": n,
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
        )
    manifest = {"address": address, "tokenizer": vocab, "shards": files}
    (prefix / "manifest.json").write_text(json.dumps(manifest))
    return {"address": address, "uri": str(prefix), "manifest": manifest}
