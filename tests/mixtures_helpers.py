"""The corpus-scale data tests' shared parts: a JSON-lines source, the tokens a shard set holds, a trained
tokenizer.json."""

from __future__ import annotations

import json

import numpy as np

from lmyard.store import open_store


def _jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


def _tokens(shards, store_uri, split=None) -> np.ndarray:
    store = open_store(store_uri)
    parts = []
    for f in shards.manifest["shards"]:
        if split is None or f["split"] == split:
            raw = store.read_bytes(f"shards/{shards.address}/{f['name']}")
            dtype = "<u2" if shards.manifest["format"]["version"] == 1 else "<u4"
            parts.append(np.frombuffer(raw, dtype=dtype, offset=1024))
    return np.concatenate(parts)


def _train_tokenizer(path, texts, vocab_size=300) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path))
    return str(path)
