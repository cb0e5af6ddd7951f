"""A full LMYARD_CACHE disk or local store: one line, exit code 4, no retry; a full cache gives the staging space
back, a full store keeps the staged checkpoint and the rerun uploads it; a plan whose checkpoints cannot fit is
refused before the first step. The disks are real small filesystems (tmpfs; skipped where mounting is not
permitted). A run is let through the disk budget and the disk filled after its first step, while every rank
pauses (LMYARD_FAULTS=pause@1): what else on the machine filled it."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import lmyard_cmd, tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.checkpoint.full import FullCheckpointer
from lmyard.errors import ExitCode, NoSpace, StoreFull, UserError, error_for, retryable
from lmyard.run import Run
from lmyard.stages import StageError, read_result, run_stage
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


# every rank pauses after step 1 while the test fills the disk (pause@1): the fill follows the step's line within a
# second or two, even on a busy machine; the pause is all waiting once it is done
PAUSE_S = 15
LEFT = 512 * 1024  # bytes left free: heartbeats and results fit, a checkpoint (1.5 MiB) does not


def fill(disk: Path, leave: int = LEFT) -> None:
    """Fill the filesystem of `disk` until `leave` bytes are free."""
    with open(disk / "filler", "ab") as f:
        f.write(b"x" * max(0, shutil.disk_usage(disk).free - leave))


def filling_after_step_1(disk: Path, lines: list[str]):
    """An on_line that records the lines and fills `disk` once step 1 is logged (the ranks pause then)."""

    def on_line(line: str) -> None:
        lines.append(line)
        if re.search(r"\bstep 1/", line) and not (disk / "filler").exists():
            fill(disk)

    return on_line


def _pausing(monkeypatch, faults: str = "pause@1") -> None:
    monkeypatch.setenv("LMYARD_FAULTS", faults)
    monkeypatch.setenv("LMYARD_FAULT_PAUSE_S", str(PAUSE_S))


def _smoke(tmp_path: Path, steps: int, **extra):
    """The smoke recipe, tiny, tokenized and sharded: (config, train spec)."""
    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.recipes import load_recipe

    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=steps, **{"eval.interval": 1000, **extra}))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    return cfg, {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}


def _steps_logged(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.search(r"\bstep (\d+)/\d+ \|", line))]


def _state(step: int) -> dict:
    return {"step": step, "cursor": 0, "tokens_seen": 0, "world_size": 1, "shard_address": "a"}


def test_a_checkpoint_that_does_not_fit_the_staging_disk_is_no_space_naming_the_folder(tmp_path):
    with small_disk(tmp_path / "cache", "256k") as cache:
        writer = FullCheckpointer(Run("full", open_store(str(tmp_path / "store"))), str(cache / "staging"))
        writer.save_state({"w": torch.zeros(256 * 1024)}, {"state": {}, "param_groups": []}, _state(2), [])  # 1 MiB
        with pytest.raises(
            NoSpace, match=re.escape(f"no space left in {cache}/staging/full (") + r".* free, 1.0 MiB needed\)"
        ):
            writer.flush(timeout_s=60)
        assert not (cache / "staging" / "full" / "step_00000002").exists()  # the half-written folder is gone
        writer.discard()
        assert not (cache / "staging" / "full").exists()
        assert complete_steps(Run("full", open_store(str(tmp_path / "store")))) == []


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
    from lmyard.launch.launcher import launch
    from lmyard.recipes import load_recipe
    from lmyard.stages import ShardSpec

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


def test_a_last_checkpoint_that_does_not_fit_the_cache_ends_every_rank_with_no_space_naming_the_cache(
    tmp_path, monkeypatch
):
    from lmyard.launch.local_job import run_local

    _pausing(monkeypatch)
    cfg, spec = _smoke(tmp_path, steps=3)  # one checkpoint: the last
    lines: list[str] = []
    with small_disk(tmp_path / "cache", "16m") as cache:
        monkeypatch.setenv("LMYARD_CACHE", str(cache))
        # the first write to fail names its folder: rank 0's staging copy, or under load another rank's own
        # record in the cache (both are LMYARD_CACHE's disk)
        with pytest.raises(NoSpace, match=re.escape(f"no space left in {cache}") + r"(/staging/smoke)? \(") as ended:
            run_local(cfg, spec, on_line=filling_after_step_1(cache, lines))
        assert "LMYARD_CACHE" in str(ended.value) and "the store" not in str(ended.value)
        assert ended.value.exit_code == 4
        assert not (cache / "staging" / "smoke").exists()
    assert cfg.launch.nproc_per_node == 2  # rank 1 must not crash in the last collective
    assert not [line for line in lines if "Traceback" in line], "\n".join(lines)


def test_a_last_checkpoint_that_does_not_fit_the_store_ends_in_its_upload_retries_naming_the_store_and_a_rerun_uploads_it(
    tmp_path, monkeypatch
):
    from lmyard.launch.local_job import run_local

    _pausing(monkeypatch)
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    lines: list[str] = []
    with small_disk(tmp_path / "store", "32m") as store:  # the shards and the checkpoints
        cfg, spec = _smoke(tmp_path, steps=3, **{"checkpoint.upload_retries": 1})
        t0 = time.monotonic()
        with pytest.raises(NoSpace) as ended:  # the launcher's: status no_space, not retried
            run_local(cfg, spec, on_line=filling_after_step_1(store, lines))
        message, took = str(ended.value), time.monotonic() - t0
        staged = tmp_path / "cache" / "staging" / "smoke" / "step_00000003"
        assert message.startswith(f"no space left in the store {store} (") and " MiB free)" in message, message
        assert "LMYARD_CACHE" not in message and f"kept staged in {staged}" in message
        assert message.endswith("then rerun: it uploads it first") and "\n" not in message
        assert ended.value.exit_code == 4 and not retryable(ended.value)
        # one round of upload_retries=1 while training, one after the last step; never a wait for a next save
        assert took < PAUSE_S + 240, took
        assert sum("trying again at the next save" in line for line in lines) <= 1, "\n".join(lines)
        assert (staged / "model.pt").exists() and (staged / "staged.json").exists()  # kept for the rerun
        assert not [line for line in lines if "Traceback" in line], "\n".join(lines)

        (store / "filler").unlink()  # space is freed
        monkeypatch.delenv("LMYARD_FAULTS")
        again: list[str] = []
        result = run_local(cfg, spec, on_line=again.append)
        assert complete_steps(Run("smoke", open_store(str(store)))) == [3]
    assert result.step == 3 and result.start_step == 3 and _steps_logged(again) == [], "\n".join(again)
    assert any("checkpoint step 3 was left staged" in line for line in again), "\n".join(again)
    assert not staged.exists()


def test_a_background_save_that_fails_stops_the_run_at_that_save(tmp_path, monkeypatch):
    from lmyard.launch.local_job import run_local

    _pausing(monkeypatch, "pause@1,pause@5")  # the ranks pause after saving step 5: its staging fails meanwhile
    cfg, spec = _smoke(tmp_path, steps=10, **{"checkpoint.interval": 5})
    lines: list[str] = []
    with small_disk(tmp_path / "cache", "16m") as cache:
        monkeypatch.setenv("LMYARD_CACHE", str(cache))
        with pytest.raises(NoSpace, match=re.escape(f"no space left in {cache}/staging/smoke")):
            run_local(cfg, spec, on_line=filling_after_step_1(cache, lines))
    assert max(_steps_logged(lines)) == 5, "\n".join(lines)  # not trained on to the next checkpoint (step 10)
    assert complete_steps(Run("smoke", open_store(str(tmp_path / "store")))) == []


def test_a_plan_whose_checkpoints_cannot_fit_the_cache_is_refused_before_the_first_step(tmp_path, monkeypatch):
    from lmyard.launch.local_job import run_local

    cfg, spec = _smoke(tmp_path, steps=9)  # 3 checkpoints written (every 3rd step): all 3 may be staged at once
    lines: list[str] = []
    with small_disk(tmp_path / "cache", "2m") as cache:  # 3 staged copies of a 1.4 MiB checkpoint do not fit
        monkeypatch.setenv("LMYARD_CACHE", str(cache))
        with pytest.raises(UserError) as refused:
            run_local(cfg, spec, on_line=lines.append)
    message = str(refused.value)
    assert message.startswith(f"checkpoints do not fit LMYARD_CACHE {cache}: "), message
    needed, each, free = (float(x) for x in re.findall(r"([\d.]+) MiB", message))
    assert needed == pytest.approx(3 * each, abs=0.2) and 1.0 < free <= 2.0 < needed, message
    assert "checkpoint.max_pending=2" in message and "LMYARD_CACHE at a bigger disk" in message
    assert "\n" not in message and refused.value.exit_code == 2
    assert _steps_logged(lines) == [] and not [line for line in lines if "Traceback" in line], "\n".join(lines)


def test_a_plan_whose_kept_checkpoints_cannot_fit_a_local_store_names_the_store_and_its_keys_and_counts_only_those_written(
    tmp_path,
):
    from lmyard.checkpoint import budget
    from lmyard.models.registry import resolve
    from lmyard.recipes import load_recipe

    with small_disk(tmp_path / "store", "5m") as store:  # 4 kept + 1 committing of 1.4 MiB do not fit, 2 + 1 do
        cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=30))  # 10 checkpoints written, 4 kept
        fields = {"arch": cfg.model.architecture(), **resolve(cfg.model, 256)}
        with pytest.raises(UserError, match=re.escape(f"checkpoints do not fit the store {store}: ")) as refused:
            budget.check(cfg, Run(cfg.run_name, open_store(str(store)), str(tmp_path / "cache")), fields, node_share=1)
        assert "checkpoint.keep_last=3" in str(refused.value) and "point `store` at a bigger disk" in str(refused.value)
        fewer = cfg.model_copy(
            update={"checkpoint": cfg.checkpoint.model_copy(update={"keep_last": 2, "keep_best": False})}
        )
        budget.check(
            fewer, Run(fewer.run_name, open_store(str(store)), str(tmp_path / "cache")), fields, node_share=1
        )  # 3 fit
        once = cfg.model_copy(  # a run that writes one checkpoint (its last step) needs room for one
            update={"checkpoint": cfg.checkpoint.model_copy(update={"interval": cfg.train.max_steps})}
        )
        budget.check(once, Run(once.run_name, open_store(str(store)), str(tmp_path / "cache")), fields, node_share=1)
        on_s3 = budget.disks(
            cfg, Run(cfg.run_name, open_store("s3://bucket/lmyard"), str(tmp_path / "cache")), 2**20, 2**20
        )
        assert [d.folder for d in on_s3] == [f"LMYARD_CACHE {tmp_path / 'cache'}"]  # nothing said about the store


def test_a_sharded_checkpoint_that_does_not_fit_the_store_ends_at_close_within_its_retries(tmp_path):
    from torch import nn

    from lmyard.checkpoint.dcp import ShardedCheckpointer

    model = nn.Linear(256, 256)  # 257 KiB of weights
    with small_disk(tmp_path / "store", "64k") as store:
        writer = ShardedCheckpointer(
            Run("dcp", open_store(str(store))), str(tmp_path / "staging"), retries=1, say=print
        )
        writer.save(model, None, _state(4), [])
        ended: list[BaseException] = []
        closing = threading.Thread(target=lambda: _closing(writer, ended), daemon=True)
        closing.start()
        closing.join(300)  # one round of one retry: seconds; before, the close waited for a next save forever
        assert not closing.is_alive(), "close() still waits for the store"
        assert len(ended) == 1 and isinstance(ended[0], StoreFull), ended
        assert str(ended[0]).startswith(f"no space left in the store {store} ("), ended[0]
        assert (tmp_path / "staging" / "dcp" / "step_00000004").exists()  # staged, not deleted


def _closing(writer, ended: list) -> None:
    try:
        writer.close()
    except BaseException as e:
        ended.append(e)


def _run_filling(cmd: list[str], env: dict, cwd: Path, disk: Path) -> subprocess.CompletedProcess:
    """`cmd` to its end, both streams read as they come; `disk` is filled once step 1 is logged."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def read(name: str, stream) -> None:
        on_line = filling_after_step_1(disk, out[name])
        for line in stream:
            on_line(line)

    readers = [threading.Thread(target=read, args=(n, getattr(proc, n)), daemon=True) for n in out]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=400 + PAUSE_S)
    finally:
        proc.kill()
        for reader in readers:
            reader.join(30)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out["stdout"]), "".join(out["stderr"]))


def test_a_run_whose_cache_disk_fills_ends_in_one_line_with_exit_4_and_a_rerun_after_freeing_space_resumes(
    cli_env, tmp_path
):
    overrides = tiny_overrides(tmp_path, steps=9, **{"tracking.registry": False})  # the disk is the point
    cmd = lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)])
    with small_disk(tmp_path / "cache", "16m") as cache:  # filled after step 1: a checkpoint (1.5 MiB) cannot fit
        env = {**cli_env, "LMYARD_CACHE": str(cache)}
        full = _run_filling(
            cmd, {**env, "LMYARD_FAULTS": "pause@1", "LMYARD_FAULT_PAUSE_S": str(PAUSE_S)}, tmp_path, cache
        )
        output = full.stdout + full.stderr
        errors = [line for line in full.stderr.splitlines() if line.startswith("lmyard: error:")]
        assert full.returncode == 4, output[-4000:]
        assert len(errors) == 1 and f"no space left in {cache}" in errors[0] and "LMYARD_CACHE" in errors[0]
        assert "Traceback" not in output, output[-4000:]
        assert "attempt 2" not in output  # not retried into a loop
        assert not (cache / "staging" / "smoke").exists() or not os.listdir(cache / "staging" / "smoke")
        (cache / "filler").unlink()  # space is freed
        again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert complete_steps(Run("smoke", open_store(str(tmp_path / "store"))))[-1] == 9
