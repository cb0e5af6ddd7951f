"""`lmyard export` and an export to S3 (the S3 test server): the command writes the folder and names a bad
destination; an S3 destination gets the whole folder (the export itself: tests/unit/export/test_export.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO, lmyard_cmd
from conftest import write_random_checkpoint as write_checkpoint

from lmyard.errors import UserError
from lmyard.export import hf as export
from lmyard.store import open_store

transformers = pytest.importorskip("transformers", reason="the export tests load folders with transformers (dev extra)")


def test_export_to_s3_uploads_the_whole_folder(tmp_path, s3_bucket):
    uri, _ = write_checkpoint(tmp_path / "store")
    info = export.export(
        f"{tmp_path / 'store'}/runs/r", f"s3://{s3_bucket}/models/r", step=5, cache_dir=str(tmp_path / "cache")
    )
    assert info["uri"] == f"s3://{s3_bucket}/models/r"
    keys = set(open_store(f"s3://{s3_bucket}/models/r").list(""))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= keys
    sd, dims = export.init_from_hf(f"s3://{s3_bucket}/models/r", cache_dir=str(tmp_path / "cache"))
    assert dims["n_layer"] == 2 and sd["wte.weight"].shape == (320, 32)
    with pytest.raises(UserError, match="is not empty"):
        export.export(uri, f"s3://{s3_bucket}/models/r", cache_dir=str(tmp_path / "cache"))


@pytest.mark.integration
def test_export_command_writes_the_folder_and_names_a_bad_destination(tmp_path, monkeypatch):
    uri, _ = write_checkpoint(tmp_path / "store")
    env = {**os.environ, "LMYARD_CACHE": str(tmp_path / "cache")}
    ok = subprocess.run(
        lmyard_cmd("export", f"{tmp_path / 'store'}/runs/r", "--to", str(tmp_path / "hf")),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip() == f"lmyard: exported {uri} (step 5) as GPT2LMHeadModel to {tmp_path / 'hf'}"
    again = subprocess.run(
        lmyard_cmd("export", uri, "--to", str(tmp_path / "hf")),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2
    assert again.stderr.strip() == (
        f"lmyard: error: destination {tmp_path / 'hf'} exists and is not empty: choose a new folder or delete it"
    )
