"""Hostile input and odd environments: keys that escape a local store, booleans for numbers, file modes, the
cache root, credentials in URIs, a complete checkpoint step written twice (on S3, and a run out of memory:
tests/integration/test_hardening_integration.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from checkpoint_helpers import commit_folder

from lmyard.checkpoint import retention
from lmyard.checkpoint.commit import StepExists
from lmyard.checkpoint.full import FILES
from lmyard.config import RunConfig, redact_uri
from lmyard.data.loader import default_cache_dir
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import UserError
from lmyard.launch import images
from lmyard.paths import sha256_file
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import LocalStore, open_store

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
