"""A tiktoken encoding as a Hugging Face `tokenizers` tokenizer (tokenizer.json), built offline.

The BPE merges are recovered from the ranks as tiktoken applies them: a token of
rank r is the merge of the two parts that BPE over its bytes reaches using only
ranks below r, so merges in rank order reproduce tiktoken's encoding exactly.
Pre-tokenization is the encoding's own regex, then GPT-2's byte-to-unicode map.
Works for GPT-2's BPE (`r50k_base`) and for lmyard's byte-level `bytes` encoding.
"""

from __future__ import annotations

import functools
import json
import os

from lmyard.data.tokenizer import EOT


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes onto printable unicode characters."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _text(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def _split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """BPE over `token`'s bytes with the merges of rank below `max_rank` (tiktoken's rule)."""
    parts = [bytes([b]) for b in token]
    while True:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best_rank is None or rank < best_rank):
                best, best_rank = i, rank
        if best is None:
            return parts
        parts = parts[:best] + [parts[best] + parts[best + 1]] + parts[best + 2 :]


def build_tokenizer(enc):
    """A `tokenizers.Tokenizer` that encodes and decodes as the tiktoken encoding `enc` does."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks: dict[bytes, int] = enc._mergeable_ranks
    vocab = {_text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            parts = _split(ranks, tok, rank)
            if len(parts) != 2:
                raise ValueError(f"token {tok!r} (rank {rank}) is not the merge of two lower-ranked tokens")
            merges.append((_text(parts[0]), _text(parts[1])))
    specials = dict(enc._special_tokens)
    vocab.update(specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return tokenizer


def write_tokenizer(enc, folder: str, model_max_length: int) -> list[str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for `transformers`; the files written."""
    build_tokenizer(enc).save(os.path.join(folder, "tokenizer.json"))
    eot = EOT if EOT in enc._special_tokens else None
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f, indent=1)
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
