"""Token shards: the llm.c / modded-nanogpt `.bin` format, and their manifest.

A shard is a header of 256 little-endian int32 -- magic 20240520, version,
token count -- then the tokens. Version 1 stores uint16 tokens (ids up to
65,535: GPT-2, p50k, bytes), so llm.c and modded-nanogpt read our shards
unchanged. Version 2 is lmyard's extension for wider vocabularies
(cl100k_base, o200k_base): the same header, then uint32 tokens.

A shard set lives at `shards/<address>/` in the store (its keys come from
lmyard.layout.ShardLayout): `{train,val}_NNNNNN.bin` and `manifest.json`,
written last. Without its manifest a shard set does not exist.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lmyard.data.shardset import ShardSet
from lmyard.errors import UserError
from lmyard.layout import ShardLayout

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSION_U16 = 1
VERSION_U32 = 2


def token_dtype(n_vocab: int) -> tuple[int, np.dtype]:
    """(format version, numpy dtype) able to hold ids 0..n_vocab-1."""
    if n_vocab - 1 <= np.iinfo(np.uint16).max:
        return VERSION_U16, np.dtype("<u2")
    if n_vocab - 1 <= np.iinfo(np.uint32).max:
        return VERSION_U32, np.dtype("<u4")
    raise UserError(f"a vocabulary of {n_vocab} ids does not fit the shard format (uint32 at most)")


def _dtype_for_version(version: int, path: str) -> np.dtype:
    if version == VERSION_U16:
        return np.dtype("<u2")
    if version == VERSION_U32:
        return np.dtype("<u4")
    raise ValueError(f"{path}: unknown shard format version {version} (this lmyard reads 1 and 2)")


def encode_shard(tokens: np.ndarray, version: int) -> bytes:
    """Header + tokens as bytes. Raises if a token id does not fit the version's type."""
    dtype = _dtype_for_version(version, "<new shard>")
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise UserError(
            f"token id {int(tokens.max())} does not fit shard format version {version} "
            f"({dtype.name}); the tokenizer's vocabulary needs version {VERSION_U32}"
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, version, tokens.size)
    return header.tobytes() + tokens.astype(dtype, copy=False).tobytes()


def write_shard(path: str | Path, tokens: np.ndarray, version: int) -> None:
    Path(path).write_bytes(encode_shard(tokens, version))


def read_header(path: str | Path) -> tuple[int, int]:
    """(version, token count) of a shard, after checking the magic number and the file size."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header.size < HEADER_INTS or header[0] != MAGIC:
        raise ValueError(f"{path}: not a token shard (magic number {MAGIC} missing)")
    version, count = int(header[1]), int(header[2])
    dtype = _dtype_for_version(version, str(path))
    expected = HEADER_BYTES + count * dtype.itemsize
    actual = Path(path).stat().st_size
    if actual != expected:
        raise ValueError(f"{path}: {actual} bytes, but the header promises {expected} ({count} tokens): truncated?")
    return version, count


def read_shard(path: str | Path) -> np.ndarray:
    """The tokens of a shard, memory-mapped (read-only)."""
    version, count = read_header(path)
    return np.memmap(path, dtype=_dtype_for_version(version, str(path)), mode="r", offset=HEADER_BYTES, shape=(count,))


def shard_prefix(address: str) -> str:
    from lmyard.layout import ShardLayout

    return ShardLayout(address).root


def load_manifest(store, address: str) -> ShardSet | None:
    layout = ShardLayout(address)
    if not store.exists(layout.manifest):
        return None
    manifest = json.loads(store.read_bytes(layout.manifest))
    return ShardSet(address=address, uri=store.uri(layout.root), manifest=manifest)


def lopsided_split(tokens: dict[str, int], val_every: int) -> str | None:
    """A warning when the val split holds far more of the tokens than data.val_every's share of the documents
    (one huge document landed in it): training would see little of the corpus."""
    share = tokens["val"] / max(1, tokens["train"] + tokens["val"])
    expected = 1 / val_every
    if tokens["val"] <= 5 * tokens["train"] / (val_every - 1):  # up to 5x its share of documents' tokens
        return None
    return (
        f"warning: the val split holds {100 * share:.1f}% of the tokens ({tokens['val']:,} val against "
        f"{tokens['train']:,} train), where data.val_every={val_every} puts {100 * expected:.1f}% of the documents "
        "there: a few large documents fell into it. Split large documents (one per line or file), or change "
        "data.val_every"
    )
