"""A tokenizer.json on S3 (the S3 test server) tokenizes the shards as `tokenizers` does (the rest of corpus-scale
data: tests/unit/data/test_mixtures.py)."""

from __future__ import annotations

from mixtures_helpers import _jsonl, _tokens, _train_tokenizer

from lmyard.data.sharding import tokenize_and_shard
from lmyard.recipes import load_recipe

# ---------------------------------------------------------------- tokenizer.json


def test_a_tokenizer_json_loads_from_s3(s3_server, s3_bucket, tmp_path):
    from tokenizers import Tokenizer

    docs = [f"item {i} costs {i * 3} coins" for i in range(40)]
    path = _train_tokenizer(tmp_path / "tokenizer.json", docs)
    s3_server.client().upload_file(path, s3_bucket, "tok/tokenizer.json")
    src = _jsonl(tmp_path / "c.jsonl", docs)
    cfg = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            f"data.source={src}",
            "data.num_proc=1",
            f"tokenizer.file=s3://{s3_bucket}/tok/tokenizer.json",
            "tokenizer.eos=</s>",
        ],
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    tok = Tokenizer.from_file(path)
    eos = tok.token_to_id("</s>")
    expected = [t for i, d in enumerate(docs) if i % 10 for t in [*tok.encode(d, add_special_tokens=False).ids, eos]]
    assert _tokens(shards, cfg.store, "train").tolist() == expected
