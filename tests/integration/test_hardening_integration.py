"""Hostile input and odd environments on the S3 test server: keys that escape, rewritten sources; and a run out of
memory is one line, not retried (the rest: tests/unit/house/test_hardening.py)."""

from __future__ import annotations

import json

import pytest

from lmyard.checkpoint.resume import load_step
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import UserError
from lmyard.layout import RunLayout
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store


def _text_docs(tag: str, n: int = 8) -> list[bytes]:
    return [f"{tag} document {i}: ".encode() + (tag * 40).encode() for i in range(n)]


# ---------------------------------------------------------------- keys confined to their folders


@pytest.mark.slow
def test_s3_source_key_with_dotdot_is_refused_not_written_outside_the_cache(s3_server, s3_bucket, tmp_path):
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="data/a.txt", Body=b"a harmless document")
    s3.put_object(Bucket=s3_bucket, Key="data/../../x/pwned.txt", Body=b"planted")
    cache = tmp_path / "cache"
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"data.source=s3://{s3_bucket}/data/*.txt"])
    with pytest.raises(UserError, match=r"data/\.\./\.\./x/pwned\.txt.*would leave its folder"):
        tokenize_and_shard(cfg, log=lambda s: None, cache_dir=str(cache))
    planted = list(tmp_path.rglob("pwned.txt"))
    assert planted == []


@pytest.mark.slow
def test_file_names_in_an_s3_checkpoint_manifest_stay_in_the_load_cache(s3_server, s3_bucket, tmp_path):
    store = open_store(f"s3://{s3_bucket}/lmyard")
    prefix = RunLayout("r").step(3)
    store.write_bytes(f"{prefix}/../../../../evil.pt", b"planted")
    manifest = {"step": 3, "files": {"../../../../evil.pt": {"bytes": 7, "sha256": "0" * 64}}}
    store.write_bytes(f"{prefix}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(UserError, match=r"checkpoint file '\.\./\.\./\.\./\.\./evil\.pt' would leave its folder"):
        load_step(Run("r", store), 3, str(tmp_path / "cache"))
    assert list(tmp_path.rglob("evil.pt")) == []


# ---------------------------------------------------------------- source cache keyed by content


@pytest.mark.slow
def test_s3_object_rewritten_with_the_same_size_is_read_again(s3_server, s3_bucket, tmp_path):
    s3 = s3_server.client()
    old, new = _text_docs("a"), _text_docs("b")
    assert [len(d) for d in old] == [len(d) for d in new]
    for i, body in enumerate(old):
        s3.put_object(Bucket=s3_bucket, Key=f"src/{i}.txt", Body=body)
    overrides = [f"store={tmp_path / 'store'}", f"data.source=s3://{s3_bucket}/src/*.txt", "data.val_every=4"]
    cache = str(tmp_path / "cache")
    first, _ = tokenize_and_shard(load_recipe("smoke", overrides), log=lambda s: None, cache_dir=cache)
    for i, body in enumerate(new):  # same keys, same sizes, other bytes
        s3.put_object(Bucket=s3_bucket, Key=f"src/{i}.txt", Body=body)
    second, _ = tokenize_and_shard(load_recipe("smoke", overrides), log=lambda s: None, cache_dir=cache)

    local = tmp_path / "local"
    local.mkdir()
    for i, body in enumerate(new):
        (local / f"{i}.txt").write_bytes(body)
    expected, _ = tokenize_and_shard(
        load_recipe("smoke", [*overrides[:1], f"data.source={local}/*.txt", "data.val_every=4"]),
        log=lambda s: None,
        cache_dir=cache,
    )
    assert second.address != first.address
    assert [s["sha256"] for s in second.manifest["shards"]] == [s["sha256"] for s in expected.manifest["shards"]]


# ---------------------------------------------------------------- credentials in URIs


def test_out_of_memory_is_one_line_naming_the_setting_and_is_not_retried(cli_env, tmp_path):
    """A micro-batch far beyond the memory the trainer may use (an address-space limit stands in for a small
    machine): exit 2, one line naming train.micro_batch, one attempt only."""
    import resource
    import subprocess

    from conftest import lmyard_cmd, tiny_overrides

    limit = 8 << 30
    overrides = tiny_overrides(
        tmp_path, steps=4, **{"run_name": "oom", "train.micro_batch": 131072, "train.batch_tokens": 131072 * 64 * 2}
    )
    done = subprocess.run(
        lmyard_cmd("run", "smoke", *[x for o in overrides for x in ("--set", o)]),
        env=cli_env,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("lmyard: error:")]
    assert len(errors) == 1 and "out of memory" in errors[0] and "lower train.micro_batch" in errors[0]
    assert "Traceback" not in done.stderr.split("lmyard: error:")[-1]
    assert "Retry 1/" not in done.stderr  # the train task is not retried: the same config cannot fit
