"""Tokenizers: tiktoken encodings by name, a .tiktoken ranks file, or bytes.

`bytes` is built in code (256 byte tokens + <|endoftext|> = 257 ids): it
needs no download, so the smoke recipe runs offline. Named encodings come
from tiktoken (`r50k_base` is GPT-2's exact BPE); air-gapped machines point
`tokenizer.ranks_file` at a local or s3:// copy of the ranks, or set
TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache.
"""

from __future__ import annotations

import base64
import functools
import hashlib

import tiktoken

from lmyard.config import TokenizerConfig
from lmyard.errors import UserError

EOT = "<|endoftext|>"
ALIASES = {"gpt2": "r50k_base"}
NAMED = ("r50k_base", "p50k_base", "cl100k_base", "o200k_base")
# GPT-2's pre-tokenizer split (tiktoken's r50k pattern); the byte encoding reuses it.
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def byte_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="bytes",
        pat_str=_R50K_PAT,
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={EOT: 256},
    )


def _parse_ranks(data: bytes, where: str) -> dict[bytes, int]:
    try:
        return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines() if line)}
    except (ValueError, TypeError):
        raise UserError(f"tokenizer.ranks_file {where}: not a .tiktoken ranks file "
                        "(expected lines of '<base64 token> <rank>')") from None


def _read_ranks_file(uri: str) -> bytes:
    if uri.startswith("s3://"):
        from lmyard.store import open_store

        bucket_key = uri.removeprefix("s3://")
        bucket, _, key = bucket_key.partition("/")
        return open_store(f"s3://{bucket}").read_bytes(key)
    try:
        with open(uri.removeprefix("file://"), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"tokenizer.ranks_file {uri!r} does not exist") from None


def _constructor(name: str):
    import tiktoken_ext.openai_public as op

    return getattr(op, name)


@functools.lru_cache(maxsize=8)
def _load(name: str, ranks_file: str | None) -> tiktoken.Encoding:
    if name == "bytes":
        if ranks_file:
            raise UserError("tokenizer.ranks_file is set but tokenizer.name is `bytes`; name the encoding it holds")
        return byte_encoding()
    name = ALIASES.get(name, name)
    if name not in NAMED:
        raise UserError(f"unknown tokenizer {name!r}: choose `bytes` or one of {', '.join(('gpt2',) + NAMED)}")
    if ranks_file:
        ranks = _parse_ranks(_read_ranks_file(ranks_file), ranks_file)
        # The encoding's pattern and special tokens come from tiktoken's own definition;
        # only the ranks come from the file, so no download is attempted.
        import tiktoken_ext.openai_public as op

        original = op.load_tiktoken_bpe
        op.load_tiktoken_bpe = lambda *a, **k: ranks
        try:
            spec = _constructor(name)()
        finally:
            op.load_tiktoken_bpe = original
        return tiktoken.Encoding(**spec)
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 - tiktoken raises requests/OS errors when offline
        raise UserError(
            f"tokenizer {name!r} could not be loaded ({type(e).__name__}): this machine may be offline. "
            f"Set tokenizer.ranks_file to a local or s3:// copy of {name}.tiktoken, or set "
            "TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache") from None


def get_tokenizer(cfg: TokenizerConfig) -> tiktoken.Encoding:
    return _load(cfg.name, cfg.ranks_file)


def eot_id(enc: tiktoken.Encoding) -> int:
    return enc.eot_token


def identity(enc: tiktoken.Encoding) -> dict:
    """What distinguishes this tokenizer in a content address: name, vocab, and a hash of its ranks."""
    h = hashlib.sha256()
    for tok, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(tok)
        h.update(rank.to_bytes(4, "little"))
    return {"name": enc.name, "n_vocab": enc.n_vocab, "eot": enc.eot_token, "ranks_sha256": h.hexdigest()}
