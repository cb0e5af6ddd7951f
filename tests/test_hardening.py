"""Hostile input and odd environments: keys that escape, rewritten sources, booleans for numbers, file modes,
the cache root, credentials in URIs, a complete checkpoint step written twice."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from checkpoint_helpers import commit_folder

from lmyard.checkpoint import retention
from lmyard.checkpoint.commit import StepExists
from lmyard.checkpoint.full import FILES
from lmyard.checkpoint.resume import load_step
from lmyard.config import RunConfig, redact_uri
from lmyard.data.loader import default_cache_dir
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import UserError
from lmyard.launch import images
from lmyard.layout import RunLayout
from lmyard.paths import sha256_file
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import LocalStore, open_store


def _text_docs(tag: str, n: int = 8) -> list[bytes]:
    return [f"{tag} document {i}: ".encode() + (tag * 40).encode() for i in range(n)]


# ---------------------------------------------------------------- keys confined to their folders


def test_local_store_refuses_keys_that_leave_its_folder(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    for key in ("../escape.txt", "runs/../../escape.txt", "/tmp/escape.txt"):
        with pytest.raises(UserError, match="would leave its folder") as e:
            store.write_bytes(key, b"x")
        assert key in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "escape.txt").exists()
    store.write_bytes("runs/a/b.json", b"{}")
    assert store.read_bytes("runs/a/b.json") == b"{}"


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


# ---------------------------------------------------------------- strict config types


@pytest.mark.parametrize(
    "assignment",
    [
        "train.max_steps=true",
        "train.lr=false",
        "model.n_layer=true",
        "checkpoint.upload_retries=true",
        "tracking.lease_ttl_s=true",
    ],
)
def test_booleans_are_refused_for_numbers_with_one_line(assignment):
    with pytest.raises(UserError) as e:
        load_recipe("smoke", [assignment])
    msg = str(e.value)
    assert assignment.split("=")[0] in msg and "not the boolean" in msg and "\n" not in msg


def test_numbers_still_pass_ints_for_floats_and_yaml_recipes(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  max_steps: 7\n  lr: 1\n  grad_clip: 0.5\nmodel:\n  bias: false\n")
    cfg = load_recipe(str(recipe), ["eval.poll_s=2"])
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.grad_clip, cfg.eval.poll_s) == (7, 1.0, 0.5, 2.0)
    assert isinstance(cfg.train.lr, float) and cfg.model.bias is False


# ---------------------------------------------------------------- file modes


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_store_files_follow_the_umask_like_data_files(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        store = open_store(str(tmp_path / "store"))
        store.write_bytes("runs/r/lineage.json", b"{}")
        store.write_bytes("runs/r/checkpoints/step_00000003/evaluated.json", b"{}")
        retention.protect_checkpoint(Run("r", store), 3)
        (tmp_path / "data.bin").write_bytes(b"123")
        store.upload(str(tmp_path / "data.bin"), "shards/x/train_000000.bin")
        staged = tmp_path / "staged"
        staged.mkdir()
        for name in FILES:
            (staged / name).write_bytes(name.encode())
        files = {n: {"bytes": len(n), "sha256": sha256_file(str(staged / n))} for n in FILES}
        commit_folder(Run("r", store), str(staged), {"step": 6, "files": files})
    finally:
        os.umask(old)
    root = Path(store.root)
    written = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert {p.name for p in written} >= {
        "lineage.json",
        "evaluated.json",
        "protected.json",
        "manifest.json",
        "train_000000.bin",
        "model.pt",
    }
    assert {p.relative_to(root).as_posix(): oct(p.stat().st_mode & 0o777) for p in written} == {
        p.relative_to(root).as_posix(): oct(mode) for p in written
    }


# ---------------------------------------------------------------- a complete step is never overwritten


def test_a_complete_checkpoint_step_is_never_overwritten(tmp_path):
    store = open_store(str(tmp_path / "store"))

    def staged(content: bytes) -> tuple[str, dict]:
        folder = tmp_path / f"staged-{content.decode()}"
        folder.mkdir()
        for name in FILES:
            (folder / name).write_bytes(content + name.encode())
        files = {n: {"bytes": len(content) + len(n), "sha256": sha256_file(str(folder / n))} for n in FILES}
        return str(folder), {"step": 9, "files": files}

    commit_folder(Run("r", store), *staged(b"first"))
    before = {n: store.read_bytes(f"runs/r/checkpoints/step_{9:08d}/{n}") for n in FILES}
    with pytest.raises(StepExists, match="already exists complete"):
        commit_folder(Run("r", store), *staged(b"second"))
    assert {n: store.read_bytes(f"runs/r/checkpoints/step_{9:08d}/{n}") for n in FILES} == before


# ---------------------------------------------------------------- one cache root


def test_every_cache_lives_under_lmyard_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LMYARD_IMAGE_CACHE", raising=False)
    assert default_cache_dir() == str(tmp_path / "cache")
    assert images.cache_dir() == tmp_path / "cache" / "images"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"text": "good line"}\n{"text": "bad \xff byte"}\n' * 5)
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"data.source={corpus}", "data.on_decode_error=skip"])
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    tokenize_and_shard(cfg, log=lambda s: None)  # no cache_dir given: its work folder goes under the root
    assert (tmp_path / "cache").is_dir() and os.listdir(tmp_path / "tmp") == []  # nothing left in the temp dir

    monkeypatch.delenv("LMYARD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "lmyard")


# ---------------------------------------------------------------- credentials in URIs


def test_credentials_in_uris_are_redacted_from_params_and_dumps():
    cfg = load_recipe(
        "smoke",
        [
            "tracking.uri=https://alice:s3cret@mlflow.example:5000/root",
            "store=s3://bucket/prefix",
            "data.source=s3://bucket/data/*.txt",
        ],
    )
    assert "s3cret" not in json.dumps(cfg.flat()) and "s3cret" not in json.dumps(cfg.redacted_dump())
    assert cfg.flat()["tracking.uri"] == "https://alice:***@mlflow.example:5000/root"
    assert cfg.redacted_dump()["store"] == "s3://bucket/prefix"
    assert cfg.tracking.uri == "https://alice:s3cret@mlflow.example:5000/root"  # the config itself still connects
    assert redact_uri("postgresql://mlflow:pw@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert redact_uri("ssh://deploy@gpu-1") == "ssh://deploy@gpu-1"
    assert RunConfig().redacted_dump() == RunConfig().model_dump(mode="json")


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
