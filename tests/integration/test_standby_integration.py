"""Warm standbys (lmyard.launch.standby): a restarted attempt's torchrun and ranks start in processes that imported
torch while the attempt before trained; they take the process's streams, signals and exit code, refuse one of
another environment, and leave no process behind."""

from __future__ import annotations

import glob
import os
import re
import time

import psutil
import pytest
from conftest import tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import Preempted
from lmyard.launch import standby
from lmyard.launch.follower import stop_all
from lmyard.launch.local_job import run_local
from lmyard.recipes import load_recipe
from lmyard.run import Run

STEP = re.compile(r"^step (\d+)/\d+ \| loss (\S+)")


def _wait_warm(n: int) -> None:
    folder, deadline = standby.pool().folder, time.monotonic() + 600
    while len(glob.glob(os.path.join(folder, "*.sock"))) < n:
        assert time.monotonic() < deadline, f"no {n} warm standbys in {folder} after 600 s"
        time.sleep(0.5)


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(m[1]): m[2] for line in lines if (m := STEP.match(line))}


@pytest.mark.integration
def test_preempted_attempts_restart_in_warm_standbys_with_the_same_losses_and_leave_no_process(tmp_path, monkeypatch):
    """Attempt 1 (the node's first) is preempted at step 2: its ranks start in standbys started beside its cold
    torchrun; attempt 2's torchrun and ranks start in the standbys, and it is preempted at step 4 (the SIGTERM
    reaches the trainer through both: step 4 committed); attempt 3, launched with another inductor cache folder,
    stops the standbys of the old one and its ranks start in new ones. Losses equal an uninterrupted cold run's."""
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LMYARD_FAULT_PAUSE_S", "8")  # the ranks pause after the faulted step: the SIGTERM lands there
    extra = {"train.compile": "false", "tracking.system_metrics": "false", "eval.interval": 100}
    cold = load_recipe("smoke", tiny_overrides(tmp_path, steps=6, run_name="cold", **extra))
    shards, _ = tokenize_and_shard(cold, log=lambda s: None)
    reference: list[str] = []
    run_local(cold, {"config": cold.model_dump(mode="json"), "shards": shards.to_dict()}, on_line=reference.append)
    cfg = cold.model_copy(update={"run_name": "warm", "launch": cold.launch.model_copy(update={"standby": True})})
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict()}
    said: list[list[str]] = [[], [], []]
    try:
        for i, stop_at in enumerate((2, 4)):
            monkeypatch.setenv("LMYARD_FAULTS", f"pause@{stop_at}")
            with pytest.raises(Preempted):
                run_local(
                    cfg,
                    spec,
                    on_line=lambda line, i=i, s=stop_at: (
                        print(i, line, flush=True)
                        or said[i].append(line)
                        or (line.startswith(f"step {s}/6") and stop_all())
                    ),
                )
            assert stop_at in complete_steps(Run.of(cfg)), said[i]
            _wait_warm(3)  # torchrun's and the two ranks'
        monkeypatch.setenv("LMYARD_FAULTS", "")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "another-node"))
        run_local(cfg, spec, on_line=said[2].append)
    finally:
        standby.close()
    ends = ["; in a warm standby)", "; torchrun and the rank in warm standbys)", "; in a warm standby)"]
    assert [any(line.endswith(end) for line in lines) for end, lines in zip(ends, said)] == [True] * 3, said
    assert not [line for lines in said for line in lines if "warm standby not used" in line], said
    resumed = {**_losses(said[0]), **_losses(said[1]), **_losses(said[2])}
    assert resumed == _losses(reference) and sorted(resumed) == [1, 2, 3, 4, 5, 6], (resumed, reference)
    left = [p for p in psutil.Process().children(recursive=True) if "lmyard.launch.standby" in " ".join(p.cmdline())]
    assert not left, f"standby processes left: {left}"


@pytest.mark.integration
def test_a_rank_waits_for_a_standby_still_warming_and_one_of_another_environment_is_refused_in_one_line(tmp_path):
    """Ranks as torchrun starts them (`python -m lmyard.launch.standby STAGE`): the first waits for the standby
    started just before it and runs in it (the stage's exit code and error from there); the second, of another
    inductor cache folder, is refused in one line and runs cold, with the same result."""
    import subprocess
    import sys

    pool = standby.Pool(folder=str(tmp_path))
    env = {**os.environ, standby.STANDBY_ENV: str(tmp_path)}
    rank = [sys.executable, "-m", "lmyard.launch.standby", "nosuch"]  # a stage that does not exist: exit 2
    try:
        assert pool.prestart(1, env) == 1 and pool.prestart(1, env) == 0  # one waiting: none more
        warm = subprocess.run(rank, env=env, capture_output=True, text=True, timeout=600)
        (first,) = pool.standbys
        assert (tmp_path / f"{first.name}.taken").exists()  # the rank ran there
        assert pool.prestart(1, env) == 1
        other = {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "another-node")}
        cold = subprocess.run(rank, env=other, capture_output=True, text=True, timeout=600)
    finally:
        pool.close()
    for proc in (warm, cold):
        assert proc.returncode == 2 and "invalid choice: 'nosuch'" in proc.stderr, proc.stderr
    said = [line for line in cold.stderr.splitlines() if "warm standby not used" in line]
    assert said == ["warm standby not used: its environment differs in TORCHINDUCTOR_CACHE_DIR"], cold.stderr
    assert "warm standby not used" not in warm.stderr
