"""A full LMYARD_CACHE disk: one line, exit code 4, no retry, the staging space given back, and a rerun once space
is freed resumes. The cache is a real small filesystem (tmpfs; skipped where mounting is not permitted)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import lmyard_cmd, tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.checkpoint.full import FullCheckpointer
from lmyard.contracts import StageError, read_result, run_stage
from lmyard.errors import ExitCode, NoSpace, error_for, retryable
from lmyard.store import open_store

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` at `path`, unmounted afterwards; skips the test where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small filesystem for the cache needs `mount -t tmpfs` (root): {mounted.stderr.decode()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _state(step: int) -> dict:
    return {"step": step, "cursor": 0, "tokens_seen": 0, "world_size": 1, "shard_address": "a"}


def test_a_checkpoint_that_does_not_fit_the_staging_disk_is_no_space_naming_the_folder(tmp_path):
    with small_disk(tmp_path / "cache", "256k") as cache:
        writer = FullCheckpointer(open_store(str(tmp_path / "store")), "full", str(cache / "staging"))
        writer.save_state({"w": torch.zeros(256 * 1024)}, {"state": {}, "param_groups": []}, _state(2), [])  # 1 MiB
        with pytest.raises(
            NoSpace, match=re.escape(f"no space left in {cache}/staging/full (") + r".* free, 1.0 MiB needed\)"
        ):
            writer.flush(timeout_s=60)
        assert not (cache / "staging" / "full" / "step_00000002").exists()  # the half-written folder is gone
        writer.discard()
        assert not (cache / "staging" / "full").exists()
        assert complete_steps(open_store(str(tmp_path / "store")), "full") == []


def test_a_full_disk_anywhere_in_a_stage_is_exit_4_and_a_result_the_launcher_does_not_retry(tmp_path):
    def produce():
        with open(cache / "heartbeat", "wb") as f:  # a plain write, as a heartbeat's: ENOSPC without a file name
            f.write(b"x" * 1024 * 1024)
        raise AssertionError("the write fits: the disk is not small")

    with small_disk(tmp_path / "cache", "64k") as cache:
        code = run_stage(produce, str(tmp_path / "result.json"))
    result = read_result((tmp_path / "result.json").read_text(), StageError)
    assert code == ExitCode.STORE_OUTAGE == 4
    assert isinstance(result, StageError) and result.status == "no_space"
    error = error_for(result.exit_code, result.message, result.status)
    assert isinstance(error, NoSpace) and not retryable(error)
    assert "LMYARD_CACHE" in result.message and "free" in result.message


def test_a_launch_whose_folder_does_not_fit_the_cache_is_no_space_before_any_process_starts(tmp_path, monkeypatch):
    from lmyard.contracts import ShardSpec
    from lmyard.launch.launcher import launch
    from lmyard.recipes import load_recipe

    cfg = load_recipe("smoke", tiny_overrides(tmp_path))
    with small_disk(tmp_path / "cache", "64k") as cache:
        with contextlib.suppress(OSError), open(cache / "filler", "wb") as f:  # whatever else filled the disk
            f.write(b"x" * 1024 * 1024)
        monkeypatch.setenv("LMYARD_CACHE", str(cache))
        with pytest.raises(NoSpace, match=re.escape(f"no space left in {cache}")):
            launch(ShardSpec(config=cfg), on_line=lambda line: None)


def test_a_spent_quota_is_no_space_too():
    from lmyard.paths import no_space

    wrapped = RuntimeError("a rank failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    error = no_space(wrapped, "/somewhere/staging")
    assert isinstance(error, NoSpace) and str(error).startswith("quota exceeded in /somewhere/staging")


def test_a_last_checkpoint_that_does_not_fit_ends_every_rank_with_no_space_and_no_traceback(tmp_path, monkeypatch):
    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.launch.follower import run_local
    from lmyard.recipes import load_recipe

    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=3, **{"eval.interval": 1000}))  # one checkpoint: the last
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    lines: list[str] = []
    with small_disk(tmp_path / "cache", "1m") as cache:  # a checkpoint of the tiny model is 1.5 MiB
        monkeypatch.setenv("LMYARD_CACHE", str(cache))
        with pytest.raises(NoSpace, match=re.escape(f"no space left in {cache}/staging/smoke")):
            run_local(cfg, spec, on_line=lines.append)
        assert not (cache / "staging" / "smoke").exists()
    assert cfg.launch.nproc_per_node == 2  # rank 1 must not crash in the last collective
    assert not [line for line in lines if "Traceback" in line], "\n".join(lines)


def test_a_run_whose_cache_disk_fills_ends_in_one_line_with_exit_4_and_a_rerun_after_freeing_space_resumes(
    cli_env, tmp_path
):
    overrides = tiny_overrides(tmp_path, steps=9)
    cmd = lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)])
    with small_disk(tmp_path / "cache", "1m") as cache:  # a checkpoint of the tiny model is 1.5 MiB
        env = {**cli_env, "LMYARD_CACHE": str(cache)}
        full = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        output = full.stdout + full.stderr
        errors = [line for line in full.stderr.splitlines() if line.startswith("lmyard: error:")]
        assert full.returncode == 4, output[-4000:]
        assert len(errors) == 1 and f"no space left in {cache}" in errors[0] and "LMYARD_CACHE" in errors[0]
        assert "Traceback" not in output, output[-4000:]
        assert "attempt 2" not in output  # not retried into a loop
        assert not (cache / "staging" / "smoke").exists() or not os.listdir(cache / "staging" / "smoke")
        subprocess.run(["mount", "-o", "remount,size=64m", str(cache)], check=True)  # space is freed
        again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert complete_steps(open_store(str(tmp_path / "store")), "smoke")[-1] == 9
