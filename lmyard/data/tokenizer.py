"""Tokenizers: tiktoken encodings by name, a .tiktoken ranks file, bytes, or a tokenizer.json.

`bytes` is built in code (256 byte tokens + <|endoftext|> = 257 ids): it
needs no download, so the smoke recipe runs offline. Named encodings come
from tiktoken (`r50k_base` is GPT-2's exact BPE); air-gapped machines point
`tokenizer.ranks_file` at a local or s3:// copy of the ranks, or set
TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache.

Design notes: docs/data.md, `lmyard/data/tokenizer.py`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os

import numpy as np
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
        raise UserError(
            f"tokenizer.ranks_file {where}: not a .tiktoken ranks file (expected lines of '<base64 token> <rank>')"
        ) from None


def _read_ranks_file(uri: str, what: str = "tokenizer.ranks_file") -> bytes:
    if uri.startswith("s3://"):
        from lmyard.store import read_object

        return read_object(uri)
    try:
        with open(uri.removeprefix("file://"), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{what} {uri!r} does not exist") from None


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
    except Exception as e:
        raise UserError(
            f"tokenizer {name!r} could not be loaded ({type(e).__name__}): this machine may be offline. "
            f"Set tokenizer.ranks_file to a local or s3:// copy of {name}.tiktoken, or set "
            "TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache"
        ) from None


class HFTokenizer:
    """A `tokenizers` tokenizer.json behind the small interface lmyard uses from tiktoken's Encoding."""

    def __init__(self, source: str, data: bytes, bos: str | None, eos: str | None):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:
            raise UserError(
                f"tokenizer.file {source!r} does not load as a Hugging Face tokenizer.json "
                f"({str(e).splitlines()[0][:200]}); point it at the tokenizer.json of a model"
            ) from None
        self.name, self.source, self.sha256 = f"tokenizer.json:{source}", source, hashlib.sha256(data).hexdigest()
        self.n_vocab = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_token, self.eos_token = (self._special(t, w) for t, w in ((bos, "bos"), (eos, "eos")))
        self.eot_token = self.bos_token if self.bos_token is not None else self.eos_token

    def _special(self, token: str | None, which: str) -> int | None:
        if token is None:
            return None
        i = self.tok.token_to_id(token)
        if i is None:
            raise UserError(
                f"tokenizer.{which} {token!r} is not a token of {self.source}; name one of its "
                "special tokens (see `added_tokens` in the tokenizer.json)"
            )
        return i

    def encode_ordinary(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_to_numpy(self, text: str, **_) -> np.ndarray:
        return np.asarray(self.encode_ordinary(text), dtype=np.uint32)

    def encode_ordinary_batch(self, texts: list[str], **_) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], errors: str = "replace") -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "tok": self.tok.to_str()}

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer

        self.__dict__.update({**state, "tok": Tokenizer.from_str(state["tok"])})


def _read_tokenizer_json(uri: str) -> bytes:
    if not uri.startswith("hf://"):
        return _read_ranks_file(uri, "tokenizer.file")
    repo, _, revision = uri.removeprefix("hf://").partition("@")
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo, "tokenizer.json", revision=revision or None)
    except Exception as e:
        raise UserError(
            f"tokenizer.file {uri!r}: tokenizer.json could not be fetched from the hub "
            f"({type(e).__name__}); check the repo name, the network or HF_TOKEN, or give a local "
            "copy"
        ) from None
    with open(path, "rb") as f:
        return f.read()


@functools.lru_cache(maxsize=8)
def _load_file(uri: str, bos: str | None, eos: str | None) -> HFTokenizer:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per tokenizer process
    return HFTokenizer(uri, _read_tokenizer_json(uri), bos, eos)


def get_tokenizer(cfg: TokenizerConfig):
    """tiktoken's Encoding, or an HFTokenizer for tokenizer.file (same methods: encode_ordinary, decode ...)."""
    if cfg.file is not None:
        return _load_file(cfg.file, cfg.bos, cfg.eos)
    return _load(cfg.name, cfg.ranks_file)


def separators(enc, cfg: TokenizerConfig) -> tuple[int | None, int | None]:
    """(id written before each document, id written after it); None: nothing."""
    if isinstance(enc, HFTokenizer):
        return enc.bos_token, enc.eos_token
    ids = []
    for token, which in ((cfg.bos, "bos"), (cfg.eos, "eos")):
        if token is None:
            ids.append(enc.eot_token if which == "bos" and cfg.eos is None else None)
        elif token in enc._special_tokens:
            ids.append(enc._special_tokens[token])
        else:
            raise UserError(
                f"tokenizer.{which} {token!r} is not a special token of {enc.name}; "
                f"choose one of {sorted(enc._special_tokens)}"
            )
    return ids[0], ids[1]


def eot_id(enc) -> int:
    return enc.eot_token


def identity(enc, cfg: TokenizerConfig | None = None) -> dict:
    """What distinguishes this tokenizer in a content address: name, vocab, a hash of its ranks or file, separators."""
    if isinstance(enc, HFTokenizer):
        return {
            "name": enc.name,
            "n_vocab": enc.n_vocab,
            "bos": enc.bos_token,
            "eos": enc.eos_token,
            "json_sha256": enc.sha256,
        }
    h = hashlib.sha256()
    for tok, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(tok)
        h.update(rank.to_bytes(4, "little"))
    out = {"name": enc.name, "n_vocab": enc.n_vocab, "eot": enc.eot_token, "ranks_sha256": h.hexdigest()}
    if cfg is not None and (cfg.bos is not None or cfg.eos is not None):  # the default (eot before) adds nothing
        out["bos"], out["eos"] = separators(enc, cfg)
    return out
