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
    """Attempt 1 (cold) is preempted at step 2; attempt 2's torchrun and ranks start in the standbys, and it is
    preempted at step 4 (the SIGTERM reaches the trainer through both: step 4 committed); attempt 3, launched with another
    inductor cache folder, is refused by the standbys and runs cold. Losses equal an uninterrupted cold run's."""
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
    warm = [any(line.endswith("; torchrun and the rank in warm standbys)") for line in lines) for lines in said]
    assert warm == [False, True, False], said
    refused = [line for line in said[2] if "warm standby not used" in line]  # torchrun's and each rank's, once
    assert len(refused) == 3 and all("TORCHINDUCTOR_CACHE_DIR" in line for line in refused), said[2]
    resumed = {**_losses(said[0]), **_losses(said[1]), **_losses(said[2])}
    assert resumed == _losses(reference) and sorted(resumed) == [1, 2, 3, 4, 5, 6], (resumed, reference)
    left = [p for p in psutil.Process().children(recursive=True) if "lmyard.launch.standby" in " ".join(p.cmdline())]
    assert not left, f"standby processes left: {left}"
