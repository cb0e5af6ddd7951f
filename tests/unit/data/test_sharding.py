"""The tokenize-and-shard stage on local files: parallel order, real BPE, wide vocabularies, bad input."""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import gpt2_ranks_or_skip

from lmyard.config import DataConfig
from lmyard.data import sharding, sources, token_stream
from lmyard.data import shards as fmt
from lmyard.data.sharding import tokenize_and_shard
from lmyard.data.sources import PYDOC_TOPICS
from lmyard.errors import UserError
from lmyard.recipes import load_recipe
from lmyard.store import open_store


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _shard_bytes(shards, store_uri) -> dict[str, bytes]:
    store = open_store(store_uri)
    return {f["name"]: store.read_bytes(f"shards/{shards.address}/{f['name']}") for f in shards.manifest["shards"]}


def _no_manifest(root) -> bool:
    return not list(root.rglob("manifest.json"))


def test_parallel_shards_are_byte_identical_to_serial(tmp_path, monkeypatch):
    monkeypatch.setattr(token_stream, "BATCH_CHARS", 2000)  # many small batches, so the pool reorders if it can
    monkeypatch.setattr(sources, "UNIT_BYTES", 2000)  # many small read tasks (local files), likewise
    src = _jsonl(tmp_path / "c.jsonl", [f"doc {i}: " + "lorem ipsum dolor " * (i % 13) for i in range(400)])
    results = {}
    for n in (1, 2):
        store = str(tmp_path / f"store{n}")
        cfg = load_recipe(
            "smoke", [f"store={store}", f"data.source={src}", "data.shard_tokens=1000", f"data.num_proc={n}"]
        )
        shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
        results[n] = (shards.address, _shard_bytes(shards, store))
    assert results[1][0] == results[2][0], "the process count is not part of the address"
    assert len(results[1][1]) > 10
    assert results[1][1] == results[2][1]


def test_the_builtin_corpus_is_the_shipped_copy_whatever_the_interpreters_own_documentation(tmp_path):
    """An interpreter whose pydoc_data says something else (another patch release: the stage image's Python)
    reads the same documents under the same fingerprint: a lineage keeps its shard set across backends."""
    shadow = tmp_path / "shadow" / "pydoc_data"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (shadow / "topics.py").write_text("topics = {'assert': 'another release of the documentation'}\n")
    probe = (
        "import json, pydoc_data.topics as t; from lmyard.data.sources import open_source; "
        "from lmyard.config import DataConfig; s = open_source(DataConfig(), ''); "
        "print(json.dumps([len(t.topics), s.fingerprint, sum(1 for _ in s.documents())]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), *sys.path])}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    shadowed, fingerprint, documents = json.loads(out)
    assert shadowed == 1  # that interpreter's own documentation is the shadow
    here = sources.open_source(DataConfig(), "")
    assert fingerprint == here.fingerprint and documents == sum(1 for _ in here.documents()) == 79


def test_shards_equal_tiktoken_r50k_encoding_of_pydoc_topics(tmp_path):
    enc = gpt2_ranks_or_skip()
    topics = json.loads(gzip.decompress(PYDOC_TOPICS.read_bytes()))  # the shipped copy the source reads

    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", "tokenizer.name=gpt2", "data.shard_tokens=20000"])
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    store = open_store(cfg.store)
    docs = [topics[k] for k in sorted(topics)]
    for split in ("train", "val"):
        got = np.concatenate(
            [fmt.read_shard(store.local_path(f"shards/{shards.address}/{f['name']}")) for f in shards.files(split)]
        ).tolist()
        want = []
        for i, d in enumerate(docs):
            if (i % cfg.data.val_every == 0) == (split == "val"):
                want += [enc.eot_token, *enc.encode_ordinary(d)]
        assert got == want
    assert shards.manifest["format"]["version"] == fmt.VERSION_U16


def _wide_ranks_file(path) -> str:
    """A .tiktoken ranks file whose ids for common English pairs lie above 65,535."""
    ranks = {bytes([i]): i for i in range(256)}
    for j in range(70_000):  # filler ranks no UTF-8 text can hit (0xFF never occurs in UTF-8)
        ranks[b"\xff" + j.to_bytes(3, "big")] = 256 + j
    for k, tok in enumerate([b"th", b"he", b" t", b"in", b"the", b" the", b"er", b"an"]):
        ranks[tok] = 70_256 + k
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return str(path)


def test_ranks_file_with_ids_above_65535_writes_uint32_shards(tmp_path):
    from lmyard.config import TokenizerConfig
    from lmyard.data.tokenizer import get_tokenizer

    ranks = _wide_ranks_file(tmp_path / "wide.tiktoken")
    docs = ["the theory then thinned", "another doc in the set", "the end"] * 5
    src = _jsonl(tmp_path / "c.jsonl", docs)
    cfg = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            f"data.source={src}",
            "tokenizer.name=cl100k_base",
            f"tokenizer.ranks_file={ranks}",
            "data.val_every=3",
        ],
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    enc = get_tokenizer(TokenizerConfig(name="cl100k_base", ranks_file=ranks))
    assert shards.manifest["format"] == {"name": "llm.c-bin", "magic": 20240520, "version": 2, "dtype": "uint32"}
    path = open_store(cfg.store).local_path(f"shards/{shards.address}/{shards.files('train')[0]['name']}")
    assert list(np.fromfile(path, dtype="<i4", count=3)[:2]) == [20240520, 2]
    train = fmt.read_shard(path).tolist()
    want = [t for i, d in enumerate(docs) if i % 3 for t in [enc.eot_token, *enc.encode_ordinary(d)]]
    assert train == want
    assert max(train) > 65535


def test_token_ids_too_large_for_the_format_are_refused():
    from lmyard.config import TokenizerConfig
    from lmyard.data.tokenizer import get_tokenizer

    enc = get_tokenizer(TokenizerConfig(name="bytes"))
    token_stream.init_worker(enc, 256, None, np.dtype("<u1"))  # a format narrower than the vocabulary (257 ids)
    with pytest.raises(UserError, match="token id 256 does not fit.*format version 2"):
        token_stream.encode_batch(["hi"])


def test_unknown_tokenizer_is_a_user_error(tmp_path):
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", "tokenizer.name=gpt5_base"])
    with pytest.raises(UserError, match="unknown tokenizer 'gpt5_base': choose"):
        tokenize_and_shard(cfg, log=lambda s: None)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_non_utf8_byte_names_the_file_and_offset(tmp_path, kind):
    (tmp_path / "data").mkdir()
    good = b"Plain text.\n"
    bad = (
        (good + b"caf\xe9\n")
        if kind == "txt"
        else (json.dumps({"text": "ok"}).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    )
    (tmp_path / "data" / f"a.{kind}").write_bytes(good if kind == "txt" else json.dumps({"text": "a"}).encode() + b"\n")
    (tmp_path / "data" / f"b.{kind}").write_bytes(bad)
    offset = bad.index(b"\xe9")
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"data.source={tmp_path / 'data'}/*.{kind}"])
    with pytest.raises(UserError, match=rf"b\.{kind}: byte offset {offset} is not UTF-8;.*data.on_decode_error=skip"):
        tokenize_and_shard(cfg, log=lambda s: None)
    assert _no_manifest(tmp_path)


def test_skip_mode_drops_only_the_bad_documents_and_counts_them(tmp_path):
    lines = [json.dumps({"text": f"document {i}"}).encode() for i in range(12)]
    lines[4] = b'{"text": "broken \xff byte"}'
    lines[9] = b'{"text": "\xc3 half a character"}'
    src = tmp_path / "c.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    cfg = load_recipe(
        "smoke", [f"store={tmp_path / 'store'}", f"data.source={src}", "data.on_decode_error=skip", "data.val_every=2"]
    )
    logs: list[str] = []
    shards, _ = tokenize_and_shard(cfg, log=logs.append, cache_dir=str(tmp_path / "cache"))
    assert shards.manifest["documents"] == 10 and shards.manifest["skipped_documents"] == 2
    assert any(line.startswith("warning: skipped 2 documents holding non-UTF-8 bytes") for line in logs)
    store = open_store(cfg.store)
    text = b"".join(
        bytes(t for t in fmt.read_shard(store.local_path(f"shards/{shards.address}/{f['name']}")) if t < 256)
        for f in shards.manifest["shards"]
    ).decode()
    kept = {i for i in range(12) if f"document {i}" in text}
    assert kept == set(range(12)) - {4, 9}


def test_progress_reports_documents_and_tokens_per_second(tmp_path, monkeypatch):
    monkeypatch.setattr(sharding, "REPORT_EVERY_S", 0.0)
    monkeypatch.setattr(token_stream, "BATCH_CHARS", 500)
    src = _jsonl(tmp_path / "c.jsonl", [f"document {i} " * 20 for i in range(100)])
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"data.source={src}", "data.shard_tokens=2000"])
    seen: list[sharding.Progress] = []
    logs: list[str] = []
    tokenize_and_shard(cfg, log=logs.append, progress=seen.append)
    assert len(seen) > 3 and seen[-1].done and seen[-1].fraction == 1.0
    assert [p.documents for p in seen] == sorted(p.documents for p in seen)
    assert all(0 < p.fraction < 1 for p in seen[:-1])
    assert seen[-1].tokens == sum(len(f"document {i} " * 20) + 1 for i in range(100))
    assert seen[-1].tokens_per_s > 0 and seen[-1].docs_per_s > 0
    assert any("docs/s" in line and "tokens/s" in line for line in logs)


def test_shards_and_sidecars_are_the_only_files_left(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", [f"doc {i}" for i in range(50)])
    cache = tmp_path / "cache"
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"data.source={src}", "data.shard_tokens=64"])
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(cache))
    names = sorted(os.listdir(tmp_path / "store" / "shards" / shards.address))
    bins = sorted(f["name"] for f in shards.manifest["shards"])
    assert names == sorted(bins + [b.replace(".bin", ".json") for b in bins] + ["manifest.json"])
    assert not [p for p in cache.rglob("*") if p.is_file()], "no temporary shard stays behind"


def test_a_val_split_that_takes_most_of_the_tokens_is_warned_about(tmp_path):
    """Document 0 goes to validation: one huge document there leaves training a sliver of the corpus."""
    docs = ["word " * 20_000] + [f"document {i} is short." for i in range(1, 40)]
    cfg = load_recipe(
        "smoke", [f"store={tmp_path / 'store'}", f"data.source={_jsonl(tmp_path / 'c.jsonl', docs)}", "data.num_proc=1"]
    )
    said: list[str] = []
    shards, _ = tokenize_and_shard(cfg, log=said.append)
    warned = [s for s in said if "the val split holds" in s]
    assert len(warned) == 1 and "data.val_every=10" in warned[0], said
    assert shards.tokens("val") > 50 * shards.tokens("train")
    balanced = load_recipe("smoke", [f"store={tmp_path / 'store2'}", "data.num_proc=1"])  # the built-in corpus
    said.clear()
    tokenize_and_shard(balanced, log=said.append)
    assert not [s for s in said if "the val split holds" in s], said
