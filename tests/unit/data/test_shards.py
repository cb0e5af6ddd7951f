"""Shard format and the tokenize-and-shard stage on local files (a shard set reused or moved:
tests/integration/test_shards_integration.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from shards_helpers import _corpus

from lmyard.data import shards as fmt
from lmyard.data.sharding import tokenize_and_shard
from lmyard.data.tokenizer import byte_encoding
from lmyard.errors import UserError
from lmyard.recipes import load_recipe
from lmyard.store import open_store


def test_shard_round_trip_keeps_header_fields_and_tokens(tmp_path):
    tokens = np.array([256, 72, 105, 256, 0, 65535], dtype=np.int64)
    path = tmp_path / "train_000000.bin"
    fmt.write_shard(path, tokens, fmt.VERSION_U16)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [20240520, 1, 6]
    assert path.stat().st_size == 1024 + 2 * 6
    assert fmt.read_shard(path).tolist() == tokens.tolist()


def test_wide_vocabulary_uses_uint32_version():
    assert fmt.token_dtype(50257) == (1, np.dtype("<u2"))
    version, dtype = fmt.token_dtype(100277)
    assert version == 2 and dtype == np.dtype("<u4")


def test_token_too_large_for_format_is_refused(tmp_path):
    with pytest.raises(UserError, match="does not fit shard format version 1"):
        fmt.write_shard(tmp_path / "x.bin", np.array([70000]), fmt.VERSION_U16)


def test_truncated_shard_is_detected(tmp_path):
    path = tmp_path / "x.bin"
    fmt.write_shard(path, np.arange(100), fmt.VERSION_U16)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        fmt.read_shard(path)


def test_shards_hold_each_document_after_one_eot(tmp_path):
    docs = [f"Document number {i}: the quick brown fox, café ☕ {i * 7}." for i in range(25)]
    cfg = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            f"data.source={_corpus(tmp_path, docs)}",
            "data.shard_tokens=300",
            "data.val_every=5",
        ],
    )
    shards, reused = tokenize_and_shard(cfg, log=lambda s: None)
    assert not reused
    enc = byte_encoding()
    store = open_store(cfg.store)
    streams = {}
    for split in ("train", "val"):
        files = shards.files(split)
        assert all(f["tokens"] == 300 for f in files[:-1]), "every shard but the last is full"
        arrays = [fmt.read_shard(store.local_path(f"shards/{shards.address}/{f['name']}")) for f in files]
        streams[split] = np.concatenate(arrays).tolist()
        assert shards.tokens(split) == len(streams[split])
    expected = {"train": [], "val": []}
    for i, d in enumerate(docs):
        expected["val" if i % 5 == 0 else "train"] += [enc.eot_token, *enc.encode_ordinary(d)]
    assert streams == expected
    assert len(shards.files("train")) > 1


def test_empty_corpus_is_a_user_error(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"data.source={src}"])
    with pytest.raises(UserError, match="holds no documents"):
        tokenize_and_shard(cfg, log=lambda s: None)
    assert not list((tmp_path / "store").rglob("manifest.json"))


def test_missing_text_field_names_the_fields_there(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"content": "hello"}) + "\n")
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"data.source={src}"])
    with pytest.raises(UserError, match=r"data.text_field 'text'.*\['content'\]"):
        tokenize_and_shard(cfg, log=lambda s: None)
