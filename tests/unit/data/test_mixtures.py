"""Corpus-scale data: weighted mixtures, the shard-time shuffle, read tasks, tokenizer.json tokenizers (a
tokenizer.json on S3: tests/integration/test_mixtures_integration.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mixtures_helpers import _jsonl, _tokens, _train_tokenizer

from lmyard.data import sharding
from lmyard.data import sources as sources_mod
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import UserError
from lmyard.recipes import load_recipe

EOT = 256  # the byte tokenizer's <|endoftext|>


def _docs(tokens: np.ndarray, sep: int) -> list[tuple[int, ...]]:
    """The documents of a stream written as [sep, *tokens] each."""
    starts = np.flatnonzero(tokens == sep)
    return [tuple(tokens[a + 1 : b].tolist()) for a, b in zip(starts, [*starts[1:], tokens.size])]


def _no_manifest(root) -> bool:
    return not list(root.rglob("manifest.json"))


@pytest.fixture
def two_sources(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["a" * (20 + i % 30) for i in range(600)])
    b = _jsonl(tmp_path / "b.jsonl", ["b" * (10 + i % 17) for i in range(600)], field="body")
    return a, b


def _mix(tmp_path, a, b, share_a="weight: 3", share_b="weight: 1", *extra, store="store"):
    sources = f"data.sources=[{{source: '{a}', {share_a}}}, {{source: '{b}', text_field: body, {share_b}}}]"
    return load_recipe(
        "smoke", [f"store={tmp_path / store}", sources, "data.shard_tokens=4000", "data.num_proc=1", *extra]
    )


def test_mixture_token_shares_match_the_weights_within_one_percent(tmp_path, two_sources):
    cfg = _mix(tmp_path, *two_sources)
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    tokens = _tokens(shards, cfg.store)
    mix = shards.manifest["mixture"]
    # every token is an 'a', a 'b' or a document's <|endoftext|>; each source's documents bring one each
    assert int((tokens == ord("a")).sum()) + mix[0]["documents"] == mix[0]["tokens"]
    assert int((tokens == ord("b")).sum()) + mix[1]["documents"] == mix[1]["tokens"]
    assert mix[0]["tokens"] + mix[1]["tokens"] == tokens.size
    assert abs(mix[0]["tokens"] / tokens.size - 0.75) < 0.01
    # the mixture ends when its first source (a: 3x the share, 1.8x the tokens of b) runs out
    assert mix[0]["documents"] == 600 and mix[1]["documents"] < 600


def test_token_budgets_repeat_a_source_smaller_than_its_budget(tmp_path, two_sources):
    cfg = _mix(tmp_path, *two_sources, "tokens: 10000", "tokens: 30000")  # b holds ~11k tokens: read ~2.7 times
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    mix = shards.manifest["mixture"]
    assert 10000 <= mix[0]["tokens"] < 10000 + 51 and 30000 <= mix[1]["tokens"] < 30000 + 28
    assert mix[1]["documents"] > 1200
    assert abs(mix[0]["tokens"] / (mix[0]["tokens"] + mix[1]["tokens"]) - 0.25) < 0.01


def test_same_inputs_and_seed_give_the_same_shards_another_seed_another_address(tmp_path, two_sources, monkeypatch):
    monkeypatch.setattr(sources_mod, "UNIT_BYTES", 2000)  # many read tasks, so their order is shuffled too
    shuffle = ["data.shuffle_documents=true", "data.shuffle_buffer_tokens=3000"]
    runs = {}
    for name, extra in {
        "seed0": ["data.shuffle_seed=0"],
        "seed0-again": ["data.shuffle_seed=0", "data.num_proc=2"],
        "seed1": ["data.shuffle_seed=1"],
        "plain": [],
    }.items():
        cfg = _mix(tmp_path, *two_sources, "weight: 3", "weight: 1", *(shuffle if extra else []), *extra, store=name)
        shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
        runs[name] = (shards.address, _tokens(shards, cfg.store))
    assert runs["seed0"][0] == runs["seed0-again"][0], "the process count changed the address"
    assert np.array_equal(runs["seed0"][1], runs["seed0-again"][1]), "the process count changed the shards"
    assert len({runs[k][0] for k in ("seed0", "seed1", "plain")}) == 3
    assert not np.array_equal(runs["seed0"][1], runs["seed1"][1])
    # a shuffle reorders documents: all of source a (the one that runs out) in both, in another order
    plain, shuffled = ([d for d in _docs(runs[k][1], EOT) if d[0] == ord("a")] for k in ("plain", "seed0"))
    assert sorted(plain) == sorted(shuffled) and len(plain) == 600 and plain != shuffled


def test_read_tasks_cut_jsonl_at_any_byte_and_parquet_by_row_group(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"doc {i} " + "x\u00e9\u2028" * (i % 11) for i in range(300)]
    src = _jsonl(tmp_path / "c.jsonl", docs)
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=37)
    for unit_bytes in (1, 97, 1 << 20):  # every line its own task ... one task for the file
        units = sources_mod.make_units([(str(src), "c", src.stat().st_size)], "json", "text", "error", unit_bytes)
        assert [t for u in units for t in sources_mod.read_unit(u)[0]] == docs
    units = sources_mod.make_units([(str(tmp_path / "c.parquet"), "c", 0)], "parquet", "text", "error")
    assert len(units) == 9 and [t for u in units for t in sources_mod.read_unit(u)[0]] == docs


def test_bad_mixture_configs_are_one_line_errors(tmp_path):
    bad = {
        "data.sources=[{source: a.jsonl, weight: 0}]": "weight must be positive",
        "data.sources=[{source: a.jsonl, weight: -2}]": "weight must be positive",
        "data.sources=[{source: a.jsonl, tokens: 100}, {source: b.jsonl}]": "give every source a token budget",
        "data.sources=[{source: a.jsonl, tokenizer: {name: gpt2}}]": "sources with different tokenizers",
    }
    for override, message in bad.items():
        with pytest.raises(UserError, match=message):
            load_recipe("smoke", [f"store={tmp_path / 'store'}", override])
    with pytest.raises(UserError, match="set data.source or data.sources, not both"):
        load_recipe("smoke", ["data.source=x.jsonl", "data.sources=[{source: a.jsonl}]"])
    assert _no_manifest(tmp_path)


# ---------------------------------------------------------------- tokenizer.json


def test_tokenizer_json_gives_exactly_the_tokens_of_tokenizers_per_document(tmp_path):
    from tokenizers import Tokenizer

    docs = [f"def f{i}(x):\n    return x * {i} + 'caf\u00e9'  # <s> is text here\n" * (1 + i % 4) for i in range(120)]
    path = _train_tokenizer(tmp_path / "tokenizer.json", docs)
    src = _jsonl(tmp_path / "code.jsonl", docs)
    cfg = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            f"data.source={src}",
            f"tokenizer.file={path}",
            "tokenizer.bos=<s>",
            "tokenizer.eos=</s>",
            "data.shard_tokens=700",
            "data.val_every=4",
            "data.num_proc=1",
        ],
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    tok = Tokenizer.from_file(path)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    for split, keep in (("train", lambda i: i % 4 != 0), ("val", lambda i: i % 4 == 0)):
        expected = [
            t for i, d in enumerate(docs) if keep(i) for t in [bos, *tok.encode(d, add_special_tokens=False).ids, eos]
        ]
        assert _tokens(shards, cfg.store, split).tolist() == expected
    assert shards.manifest["tokenizer"]["bos"] == bos and shards.n_vocab == tok.get_vocab_size()


def test_shards_of_a_vocabulary_over_65536_round_trip_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["alpha", "beta", "gamma", "delta", "<|eot|>"]
    vocab = {"[UNK]": 0, **{w: 70_000 + 7 * k for k, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|eot|>"])
    tok.save(str(tmp_path / "wide.json"))
    docs = [" ".join(words[(i + k) % 4] for k in range(3 + i % 5)) for i in range(50)]
    src = _jsonl(tmp_path / "w.jsonl", docs)
    cfg = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            f"data.source={src}",
            f"tokenizer.file={tmp_path / 'wide.json'}",
            "tokenizer.bos=<|eot|>",
            "data.shard_tokens=64",
            "data.num_proc=1",
        ],
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    assert shards.manifest["format"]["version"] == 2 and shards.manifest["format"]["dtype"] == "uint32"
    eot = vocab["<|eot|>"]
    got = _docs(_tokens(shards, cfg.store, "train"), eot)
    expected = [tuple(tok.encode(d, add_special_tokens=False).ids) for i, d in enumerate(docs) if i % 10]
    assert got == expected and max(max(d) for d in got) > 65535


def test_a_tokenizer_json_that_does_not_load_is_a_user_error_and_leaves_no_manifest(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", ["some text"] * 20)
    (tmp_path / "broken.json").write_text('{"model": {"type": "BPE", "vocab": ')
    base = [f"store={tmp_path / 'store'}", f"data.source={src}", "tokenizer.bos=<s>"]
    with pytest.raises(UserError, match="does not load as a Hugging Face tokenizer.json"):
        tokenize_and_shard(load_recipe("smoke", [*base, f"tokenizer.file={tmp_path / 'broken.json'}"]))
    with pytest.raises(UserError, match="does not exist"):
        tokenize_and_shard(load_recipe("smoke", [*base, f"tokenizer.file={tmp_path / 'missing.json'}"]))
    path = _train_tokenizer(tmp_path / "ok.json", ["some text"] * 5, vocab_size=270)
    with pytest.raises(UserError, match="tokenizer.bos '<S>' is not a token"):
        tokenize_and_shard(load_recipe("smoke", [*base[:2], f"tokenizer.file={path}", "tokenizer.bos=<S>"]))
    with pytest.raises(UserError, match="tokenizer.file needs tokenizer.bos or tokenizer.eos"):
        load_recipe("smoke", [*base[:2], f"tokenizer.file={path}"])
    assert _no_manifest(tmp_path)


def test_the_default_separator_keeps_the_address_of_a_single_source(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", [f"doc {i}" for i in range(30)])
    plain = load_recipe("smoke", [f"store={tmp_path / 's'}", f"data.source={src}"])
    key = sharding.plan(plain, str(tmp_path / "cache"))[3]
    assert set(key) == {
        "source",
        "tokenizer",
        "shard_tokens",
        "split",
        "max_documents",
        "text_field",
        "on_decode_error",
        "format",
    }, "a single unshuffled source hashes the same key as before"
    assert set(key["tokenizer"]) == {"name", "n_vocab", "eot", "ranks_sha256"}


def test_a_mixture_and_a_tokenizer_json_config_survive_a_json_round_trip():
    from lmyard.config import RunConfig

    cfg = load_recipe(
        "smoke",
        [
            "data.sources=[{source: a.jsonl, weight: 2}, {source: 's3://b/c/*.parquet'}]",
            "tokenizer.file=hf://org/model",
            "tokenizer.bos=<s>",
        ],
    )
    again = RunConfig.model_validate(json.loads(json.dumps(cfg.model_dump(mode="json"))))  # as the flow passes it
    assert again == cfg and again.data.shares() == ([2.0, 1.0], None)


def test_a_streamed_source_mixes_with_files_by_token_budget(tmp_path, two_sources):
    a, _ = two_sources
    cfg = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            "data.num_proc=1",
            "data.shard_tokens=5000",
            f"data.sources=[{{source: 'builtin:pydoc-topics', tokens: 30000}}, {{source: '{a}', tokens: 10000}}]",
        ],
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    hub_like, files = shards.manifest["mixture"]
    assert 30000 <= hub_like["tokens"] < 30000 + 60000 and 10000 <= files["tokens"] < 10000 + 51
    assert sum(shards.manifest["tokens"].values()) == hub_like["tokens"] + files["tokens"]


def test_a_shuffled_mixture_resumes_to_identical_shards(tmp_path, two_sources):
    cfg = _mix(
        tmp_path,
        *two_sources,
        "weight: 1",
        "weight: 1",
        "data.shuffle_documents=true",
        "data.shuffle_buffer_tokens=2000",
        "data.shard_tokens=1000",
    )
    whole, _ = tokenize_and_shard(cfg, log=lambda s: None)
    before = _tokens(whole, cfg.store)
    root = tmp_path / "store" / "shards" / whole.address
    (root / "manifest.json").unlink()  # as if the run died: some shards and sidecars stay
    n_train = len(whole.files("train"))
    assert n_train >= 8 and len(whole.files("val")) >= 2
    for name in (f"train_{n_train - 3:06d}.bin", f"train_{n_train - 2:06d}.json", "val_000001.json"):
        (root / name).unlink()
    logs: list[str] = []
    again, reused = tokenize_and_shard(cfg, log=logs.append)
    assert not reused and any(f"{n_train - 3} train + 1 val shards" in line for line in logs), logs[:3]
    assert again.manifest["shards"] == whole.manifest["shards"]
    assert np.array_equal(_tokens(again, cfg.store), before)


def test_a_missing_field_found_by_a_tokenizer_process_is_a_user_error_without_manifest(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [f"row {i}" for i in range(50)]}), tmp_path / "p.parquet", row_group_size=10)
    cfg = load_recipe(
        "smoke", [f"store={tmp_path / 'store'}", f"data.source={tmp_path / 'p.parquet'}", "data.num_proc=2"]
    )
    with pytest.raises(UserError, match=r"data.text_field 'text' is not in .*p.parquet .*\['content'\]"):
        tokenize_and_shard(cfg, log=lambda s: None)
    assert _no_manifest(tmp_path)
    ok = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            f"data.source={tmp_path / 'p.parquet'}",
            "data.num_proc=2",
            "data.text_field=content",
            "data.val_every=5",
        ],
    )
    shards, _ = tokenize_and_shard(ok, log=lambda s: None)
    assert shards.manifest["documents"] == 50
    assert _docs(_tokens(shards, ok.store, "val"), EOT) == [tuple(f"row {i}".encode()) for i in range(0, 50, 5)]
