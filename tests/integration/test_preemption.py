"""SIGTERM to one rank of a 2-rank local run while checkpoint uploads are slow (a spot reclaim of one node's
process, a drill): every rank waits for the preemption checkpoint's commit within `launch.grace_s`, the job ends
preempted (exit 5) saying only what the store holds, and a rerun resumes from what is committed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest
from conftest import free_port, tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import ExitCode, Preempted
from lmyard.launch.job import stage_env, torchrun_command
from lmyard.launch.local_job import run_local
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.stages import RANK_EXITS_ENV, rank_exit, rank_exits
from lmyard.store import open_store

pytestmark = pytest.mark.slow
# torchrun kills the ranks left 30 s after one exits unless told otherwise: an upload slower than that
SLOW_UPLOAD_S = 33


def _sigterm_rank(tmp, rank: int) -> None:
    """SIGTERM to one rank process of the job whose files lie under `tmp` (torchrun and the other rank get none)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "lmyard.stages train" in cmd and str(tmp) in cmd:
            with contextlib.suppress(psutil.Error):
                if p.environ().get("RANK") == str(rank):
                    p.send_signal(signal.SIGTERM)
                    return
    raise AssertionError(f"no rank {rank} process found")


def _run(tmp, monkeypatch, grace_s: float, slow_s: float):
    """Train to step 4 (checkpoints every 2 steps); the ranks pause after step 3, when rank 1 gets SIGTERM and
    checkpoint 3's upload is slowed by `slow_s`. Returns (config, spec, the error, seconds from SIGTERM to end)."""
    monkeypatch.setenv("LMYARD_FAULTS", "pause@3,slow_upload@3")
    monkeypatch.setenv("LMYARD_FAULT_SLOW_S", str(slow_s))
    monkeypatch.setenv("LMYARD_CACHE", str(tmp / "cache"))
    cfg = load_recipe(
        "smoke",
        tiny_overrides(tmp, steps=4, **{"checkpoint.interval": 2, "eval.interval": 100, "launch.grace_s": grace_s}),
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    sent: list[float] = []

    def on_line(line: str) -> None:
        if line.startswith("step 3/4") and not sent:  # the ranks pause after step 3 (a fault): a known step
            _sigterm_rank(tmp, 1)
            sent.append(time.monotonic())

    with pytest.raises(Preempted) as info:
        run_local(cfg, spec, on_line=on_line)
    monkeypatch.setenv("LMYARD_FAULTS", "")
    return cfg, spec, info.value, time.monotonic() - sent[0]


def test_sigterm_to_one_rank_with_a_slow_upload_commits_the_step_before_exit_and_the_rerun_resumes_it(
    tmp_path, monkeypatch
):
    grace_s = 60
    cfg, spec, err, took = _run(tmp_path, monkeypatch, grace_s, SLOW_UPLOAD_S)
    assert err.exit_code == ExitCode.PREEMPTED
    assert "stopped by SIGTERM after step 3; checkpoint step 3 is in the store" in str(err)
    assert complete_steps(Run("smoke", open_store(cfg.store))) == [2, 3]  # committed, manifest last
    assert SLOW_UPLOAD_S <= took < grace_s + 30  # waited for the upload, within the grace (+ exit slack)
    result = run_local(cfg, spec, on_line=lambda line: None)
    assert result.start_step == 3 and result.resumed_from.endswith("step_00000003") and result.step == 4


def test_preempted_step_not_committed_within_the_grace_is_named_with_the_last_committed_one(tmp_path, monkeypatch):
    cfg, spec, err, _ = _run(tmp_path, monkeypatch, grace_s=8, slow_s=20)
    assert err.exit_code == ExitCode.PREEMPTED
    assert "checkpoint step 3 was not committed within launch.grace_s=8 s" in str(err)
    assert "the last committed checkpoint is step 2, where a rerun resumes" in str(err)
    assert "is in the store" not in str(err)
    assert 3 not in complete_steps(Run("smoke", open_store(cfg.store)))
    result = run_local(cfg, spec, on_line=lambda line: None)
    assert result.start_step == 2 and result.step == 4


RANK_SCRIPT = """
import os, signal, sys, time
from lmyard.errors import ExitCode
from lmyard.stages import rank_exit
signal.signal(signal.SIGTERM, lambda *a: None)  # the trainer's handler: the stop is already under way
if os.environ["RANK"] == "1":
    time.sleep(2)  # rank 0 has its handler by now
    sys.exit(rank_exit(ExitCode.PREEMPTED))  # nothing of its own to upload
time.sleep({busy_s})  # still committing the checkpoint
open({done!r}, "w").close()
sys.exit(rank_exit(ExitCode.PREEMPTED))
"""


def test_a_rank_still_committing_30_s_after_another_ended_preempted_is_not_killed_and_the_node_exits_5(tmp_path):
    """torchrun stops the ranks left 30 s after one exits non-zero, whatever its shutdown timeout: under the
    launcher's torchrun a preempted rank's exit does not start that, and the node still exits as preempted."""
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **{"launch.grace_s": 60}))
    done = tmp_path / "rank0-done"
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(busy_s=SLOW_UPLOAD_S, done=str(done)))
    cmd = torchrun_command(cfg)
    cmd = [*cmd[: cmd.index("-m", 3)], str(script)]  # the launcher's torchrun, running the script as its ranks
    exchange = tmp_path / "exchange"
    env = {**os.environ, **stage_env(cfg), "LMYARD_EXCHANGE_DIR": str(exchange)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SLOW_UPLOAD_S + 60)
    assert done.exists(), "torchrun killed rank 0 while it committed:\n" + proc.stderr[-2000:]
    assert proc.returncode == ExitCode.PREEMPTED, proc.stderr[-2000:]
    assert "torchrun: rank 1 exited with code 5" in proc.stderr  # the first to end, in one line
    (record,) = (exchange / "exits").iterdir()
    assert json.loads(record.read_text()) == {"0": 5, "1": 5}  # for the launcher, as any failed rank's
    assert sorted(p.name for p in exchange.iterdir()) == ["exit-times", "exits"]  # the ranks' own records are gone


NODE_RANK_SCRIPT = """
import os, signal, sys, time
from lmyard.errors import ExitCode
from lmyard.stages import rank_exit
from lmyard.run import Run
from lmyard.run import Run
signal.signal(signal.SIGTERM, lambda *a: None)  # the trainer's handler: it checkpoints, then ends
open(os.path.join({tmp!r}, "started-" + os.environ["RANK"]), "w").close()
while not os.path.exists({committed!r}):
    time.sleep(0.1)
sys.exit(rank_exit(ExitCode.PREEMPTED))
"""


def test_a_node_whose_ranks_ended_preempted_ends_at_once_when_another_nodes_torchrun_got_the_signal(tmp_path):
    """Two nodes of two ranks each; node 1's torchrun gets SIGTERM (its host is reclaimed) and every rank ends
    preempted. Node 0 exits 5 at once: torchrun's exit barrier would wait 300 s for node 1's torchrun, which
    never comes, were all of node 0's ranks to exit 0."""
    endpoint = {"launch.nnodes": 2, "launch.rdzv_endpoint": f"127.0.0.1:{free_port()}", "launch.nproc_per_node": 2}
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **endpoint))
    script, committed = tmp_path / "rank.py", tmp_path / "committed"
    script.write_text(NODE_RANK_SCRIPT.format(tmp=str(tmp_path), committed=str(committed)))
    nodes = []
    try:
        for node in (0, 1):
            cmd = torchrun_command(cfg, node=node)
            cmd = [*cmd[: cmd.index("-m", 3)], str(script)]
            env = {**os.environ, **stage_env(cfg), "LMYARD_EXCHANGE_DIR": str(tmp_path / f"node{node}")}
            with open(tmp_path / f"node{node}.log", "w") as log:
                nodes.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"started-{r}").exists() for r in range(4)):
            assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()[-2000:]
            time.sleep(0.2)
        nodes[1].send_signal(signal.SIGTERM)
        committed.touch()  # every rank has checkpointed: they end as preempted
        nodes[1].wait(timeout=120)
        assert nodes[0].wait(timeout=120) == ExitCode.PREEMPTED, (tmp_path / "node0.log").read_text()[-2000:]
        assert re.search(r"^torchrun: rank \d exited with code 5 ", (tmp_path / "node0.log").read_text(), re.M)
    finally:
        for p in nodes:
            p.kill()
            p.wait()


def test_a_preempted_rank_but_its_nodes_last_exits_0_with_its_code_recorded_only_under_the_launchers_torchrun(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(RANK_EXITS_ENV, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_exit(ExitCode.PREEMPTED) == 5  # plain torchrun, a Ray actor: as before
    monkeypatch.setenv(RANK_EXITS_ENV, str(tmp_path))
    assert rank_exit(ExitCode.STORE_OUTAGE) == 4 and rank_exit(ExitCode.CRASHED) == 1  # torchrun stops the rest
    assert rank_exits(str(tmp_path)) == []
    assert rank_exit(ExitCode.PREEMPTED) == 0
    (record,) = rank_exits(str(tmp_path))
    assert (record.rank, record.code, record.pid) == (3, 5, os.getpid())
    monkeypatch.setenv("RANK", "2")
    assert rank_exit(ExitCode.PREEMPTED) == 5  # the node's last: no rank left for torchrun to stop
    assert [x.rank for x in rank_exits(str(tmp_path))] == [3, 2]  # earliest first
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(RANK_EXITS_ENV, str(tmp_path / "file" / "exits"))
    assert rank_exit(ExitCode.PREEMPTED) == 5  # no record can be written: the code itself


def test_a_rank_killed_by_sigkill_is_named_first_not_through_the_survivors_broken_collective(tmp_path, monkeypatch):
    """Rank 1 SIGKILLs itself after step 3 (as the OOM killer would): rank 0 then fails on the broken gloo
    collective, and the error names rank 1's signal first, the survivor's error after it."""
    from lmyard.errors import TrainingFailed

    monkeypatch.setenv("LMYARD_FAULTS", "kill@3")
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=20, **{"launch.grace_s": 10}))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    with pytest.raises(TrainingFailed) as info:
        run_local(cfg, spec, on_line=lambda line: None)
    first = str(info.value).splitlines()[0]
    assert "rank 1 was killed by signal 9 (SIGKILL: the kernel's out-of-memory killer, or a kill -9)" in first, first
    assert first.index("rank 1 was killed") < first.index("rank 0 failed after it")


def test_a_rank_that_crashes_is_named_as_the_cause_and_the_survivors_traceback_stays_off_the_log(tmp_path, monkeypatch):
    """Rank 1 exits with status 1 after step 3 (no error record of its own); rank 0 then fails on the broken gloo
    collective. The failure is one line naming rank 1's crash, rank 0 following it; no traceback on the log."""
    from lmyard.errors import TrainingFailed

    monkeypatch.setenv("LMYARD_FAULTS", "crash_last@3")
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=20))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    lines: list[str] = []
    with pytest.raises(TrainingFailed) as info:
        run_local(cfg, spec, on_line=lines.append)
    said = str(info.value)
    assert said.startswith("train: rank 1 exited with code 1 first: injected crash of rank 1 after step 3"), said
    assert said.endswith("rank 0 failed after it") and "\n" not in said
    assert info.value.output[-1] == "injected crash of rank 1 after step 3"
    assert "[rank 1] injected crash of rank 1 after step 3" in lines  # its own line, said as it came
    assert not [ln for ln in lines if "Traceback" in ln or "Connection reset" in ln], lines
