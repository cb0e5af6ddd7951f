"""The tokenize-and-shard stage against a real S3-compatible HTTP server (moto, 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, free_port

from lmyard.data import sharding
from lmyard.data import shards as fmt
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import UserError
from lmyard.recipes import load_recipe
from lmyard.store import open_store

pytestmark = pytest.mark.slow


def _corpus(n: int = 60, words: int = 12) -> bytes:
    return "".join(
        json.dumps({"text": f"Document {i}. " + "a rose is a rose " * (words + i % 7)}) + "\n" for i in range(n)
    ).encode()


def _objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"].removeprefix(prefix)] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def test_shards_and_manifest_round_trip_through_s3(s3_server, s3_bucket, tmp_path):
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="corpus/part-0.jsonl", Body=_corpus())
    base = ["data.source=s3://" + s3_bucket + "/corpus/*.jsonl", "data.shard_tokens=700", "data.val_every=4"]
    cfg = load_recipe("smoke", [f"store=s3://{s3_bucket}/lmyard", *base])
    shards, reused = tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))
    assert not reused and shards.uri == f"s3://{s3_bucket}/lmyard/shards/{shards.address}"

    # The same shards through a local store, from a local copy of the same file.
    (tmp_path / "part-0.jsonl").write_bytes(_corpus())
    local_cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", *base])
    local_cfg.data.source = str(tmp_path / "part-0.jsonl")
    local, _ = tokenize_and_shard(local_cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))

    remote = _objects(s3, s3_bucket, f"lmyard/shards/{shards.address}/")
    manifest = json.loads(remote["manifest.json"])
    assert manifest["shards"] == local.manifest["shards"]
    assert len(manifest["shards"]) > 4
    for entry in manifest["shards"]:
        data = remote[entry["name"]]
        assert data == (tmp_path / "store" / "shards" / local.address / entry["name"]).read_bytes()
        assert len(data) == entry["bytes"]
        assert json.loads(remote[entry["name"].replace(".bin", ".json")])["shard"] == entry
    assert fmt.load_manifest(open_store(cfg.store), shards.address).manifest == manifest


def test_second_run_with_the_same_inputs_does_no_tokenization(s3_server, s3_bucket, tmp_path, monkeypatch):
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="in/a.jsonl", Body=_corpus())
    cfg = load_recipe("smoke", [f"store=s3://{s3_bucket}/out", f"data.source=s3://{s3_bucket}/in/a.jsonl"])
    first, reused1 = tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))
    before = s3.head_object(Bucket=s3_bucket, Key=f"out/shards/{first.address}/manifest.json")["LastModified"]

    def no_tokenizing(*a, **k):
        raise AssertionError("the second run tokenized")

    monkeypatch.setattr(sharding, "_build", no_tokenizing)
    logs: list[str] = []
    second, reused2 = tokenize_and_shard(cfg, log=logs.append, cache_dir=str(tmp_path / "cache"))
    assert (reused1, reused2) == (False, True) and second.manifest == first.manifest
    assert "nothing to tokenize" in logs[0]
    after = s3.head_object(Bucket=s3_bucket, Key=f"out/shards/{first.address}/manifest.json")["LastModified"]
    assert after == before


def test_changed_input_file_changes_the_address(s3_server, s3_bucket, tmp_path):
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="in/a.jsonl", Body=_corpus(40))
    cfg = load_recipe("smoke", [f"store=s3://{s3_bucket}/out", f"data.source=s3://{s3_bucket}/in/*.jsonl"])
    first, _ = tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))
    s3.put_object(Bucket=s3_bucket, Key="in/a.jsonl", Body=_corpus(40).replace(b"rose", b"Rose"))
    second, reused = tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))
    assert not reused and second.address != first.address
    assert second.manifest["documents"] == first.manifest["documents"] == 40


_KILLABLE = textwrap.dedent("""
    import sys, time
    from lmyard.data import sharding, token_stream
    from lmyard.recipes import load_recipe

    sharding.REPORT_EVERY_S = 0.0  # report after every batch
    token_stream.BATCH_CHARS = 2000

    def progress(p):
        if p.shards >= 6 and not p.done:
            time.sleep(1.0)  # let the upload thread finish what it has
            print("KILL-ME-NOW", flush=True)
            time.sleep(600)

    cfg = load_recipe("smoke", sys.argv[1:])
    sharding.tokenize_and_shard(cfg, log=lambda s: None, progress=progress)
    print("FINISHED", flush=True)
""")


def test_killed_run_then_rerun_gives_byte_identical_shards(s3_server, s3_bucket, tmp_path):
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="in/a.jsonl", Body=_corpus(400, words=20))
    args = [f"data.source=s3://{s3_bucket}/in/a.jsonl", "data.shard_tokens=1500", "data.num_proc=2", "data.val_every=5"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE, f"store=s3://{s3_bucket}/killed", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "KILL-ME-NOW", f"the run ended before it could be interrupted: {line!r}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage and its tokenizer processes, mid-run
        proc.wait()
        proc.stdout.close()

    killed = load_recipe("smoke", [f"store=s3://{s3_bucket}/killed", *args])
    address = sharding.plan(killed, str(tmp_path / "cache"))[2]
    leftover = _objects(s3, s3_bucket, f"killed/shards/{address}/")
    assert "manifest.json" not in leftover and any(k.endswith(".bin") for k in leftover)

    logs: list[str] = []
    seen: list[sharding.Progress] = []
    resumed, reused = tokenize_and_shard(
        killed, log=logs.append, progress=seen.append, cache_dir=str(tmp_path / "cache")
    )
    assert not reused
    kept = next(line for line in logs if line.startswith("resuming shard set"))
    assert int(kept.split(": ")[1].split(" train")[0]) >= 3, kept

    clean = load_recipe("smoke", [f"store=s3://{s3_bucket}/clean", *args])
    uninterrupted, _ = tokenize_and_shard(clean, log=lambda s: None, cache_dir=str(tmp_path / "cache"))
    assert resumed.address == uninterrupted.address
    assert resumed.manifest["shards"] == uninterrupted.manifest["shards"]
    a = _objects(s3, s3_bucket, f"killed/shards/{address}/")
    b = _objects(s3, s3_bucket, f"clean/shards/{address}/")
    bins = [k for k in b if k.endswith(".bin")]
    assert len(bins) > 8 and all(a[k] == b[k] for k in bins)
    total = sum(uninterrupted.manifest["tokens"].values())
    assert seen[-1].tokens < total, "the resumed run tokenized the kept shards again"


def test_source_too_small_for_both_splits_fails_and_leaves_no_shards_in_the_store(s3_server, s3_bucket, tmp_path):
    """One document makes a validation shard and no train tokens: the one-line error, and no
    manifest-less shard (nor sidecar) of that set left in the store."""
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="tiny/part-0.jsonl", Body=_corpus(n=1))
    cfg = load_recipe("smoke", [f"store=s3://{s3_bucket}/lmyard", f"data.source=s3://{s3_bucket}/tiny/*.jsonl"])
    with pytest.raises(UserError, match="gave no train tokens from 1 documents; add documents or lower"):
        tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))
    assert _objects(s3, s3_bucket, "lmyard/shards/") == {}


def test_missing_bucket_is_a_user_error(s3_server, tmp_path):
    cfg = load_recipe("smoke", ["store=s3://no-such-bucket-here/lmyard", "data.max_documents=20"])
    with pytest.raises(UserError, match="bucket 'no-such-bucket-here' does not exist; create it or fix `store`"):
        tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))


def test_missing_source_bucket_is_a_user_error(s3_server, tmp_path):
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", "data.source=s3://no-such-source/x/*.jsonl"])
    with pytest.raises(UserError, match="data.source s3://no-such-source/x/.*bucket does not exist"):
        tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))


def test_unreachable_endpoint_is_a_user_error(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    cfg = load_recipe("smoke", ["store=s3://any-bucket/lmyard", "data.max_documents=20"])
    with pytest.raises(UserError, match="cannot reach the S3 endpoint http://127.0.0.1:.*check AWS_ENDPOINT_URL"):
        tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))


def test_access_denied_is_a_user_error_and_leaves_no_manifest(s3_server, s3_bucket, tmp_path, monkeypatch):
    reader = s3_server.user_env(
        f"reader-{s3_bucket}", [{"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetObject"], "Resource": "*"}]
    )
    for k, v in reader.items():
        monkeypatch.setenv(k, v)
    cfg = load_recipe("smoke", [f"store=s3://{s3_bucket}/lmyard", "data.max_documents=40", "data.shard_tokens=2000"])
    with pytest.raises(UserError, match=rf"store s3://{s3_bucket}/lmyard.*access denied.*AWS_PROFILE"):
        tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(tmp_path / "cache"))
    monkeypatch.undo()
    assert not [k for k in _objects(s3_server.client(), s3_bucket, "") if k.endswith("manifest.json")]
