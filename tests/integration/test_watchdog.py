"""The watchdog: a rank that stops making progress, or never starts, gets the job killed, and the retry resumes."""

from __future__ import annotations

import time

import pytest
from conftest import tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import TrainingFailed
from lmyard.launch.local_job import run_local
from lmyard.launch.watchdog import Watchdog
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow


def _ranks_of(tmp) -> list[int]:
    """Trainer processes still running whose spec lies under `tmp`."""
    import psutil

    time.sleep(0.5)
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "lmyard.stages train" in cmd and str(tmp) in cmd and p.status() != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


def _cfg(tmp, **extra):
    return load_recipe(
        "smoke",
        tiny_overrides(
            tmp, steps=12, **{"checkpoint.interval": 4, "eval.interval": 100, "launch.watchdog_s": 6, **extra}
        ),
    )


def _first_seen(*keys: str):
    """A line handler that records when each key first appeared in the job's output, and what it recorded."""
    seen: dict[str, float] = {}

    def on_line(line: str) -> None:
        for key in keys:
            if key in line:
                seen.setdefault(key, time.monotonic())

    return seen, on_line


def test_hung_rank_is_detected_within_the_configured_time_and_the_job_killed(tmp_path, monkeypatch):
    monkeypatch.setenv("LMYARD_FAULTS", "hang@6")
    monkeypatch.setenv("LMYARD_FAULTS_STATE", str(tmp_path / "faults"))
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path)
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    seen, on_line = _first_seen("injected hang", "watchdog:")

    with pytest.raises(
        TrainingFailed, match="no training step completed for .* last heartbeats: rank-0 after step"
    ) as e:
        run_local(cfg, spec, on_line=on_line)
    assert str(e.value).endswith("; a retry resumes from the last checkpoint")  # launch.retries=1
    assert 6 <= seen["watchdog:"] - seen["injected hang"] < 6 + 5  # timeout + polling and kill slack
    assert complete_steps(Run("smoke", open_store(cfg.store))) == [4]
    assert _ranks_of(tmp_path) == [], "a killed job left ranks running (each rank has a session of its own)"

    result = run_local(cfg, spec, on_line=lambda line: None)  # the retry: resumes at step 4, the fault has fired
    assert result.step == 12


def test_startup_timeout_names_the_ranks_without_a_first_step_and_ends_once_all_have_one():
    now = [0.0]
    dog = Watchdog(None, clock=lambda: now[0], startup_s=100, ranks=3)
    now[0] = 50.0
    dog.arm()  # the job has started (after image builds): the clock counts from here
    now[0] = 149.0
    assert dog.check({"rank-0": "1"}) is None
    now[0] = 151.0
    message = dog.check({"rank-0": "1"})
    assert message and "rank-1, rank-2 completed no training step" in message
    assert "launch.startup_timeout_s=100" in message and "rank-0" not in message
    dog.check({"rank-0": "2", "rank-1": "1", "rank-2": "1"})
    assert dog.check({}) is None  # every rank has started: a read that finds no files is not a stuck start
    assert Watchdog(None, clock=lambda: now[0], startup_s=1, ranks=0).check({}) is None  # no heartbeats: unwatched


def test_ranks_whose_loop_has_ended_are_not_stalled_while_their_last_upload_runs(tmp_path):
    from lmyard.stages import Heartbeat, read_beats
    from lmyard.stages.exchange import EXCHANGE_ENV

    now = [0.0]
    dog = Watchdog(10, clock=lambda: now[0])
    folder = tmp_path / "exchange"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EXCHANGE_ENV, str(folder))
        beats = [Heartbeat(0), Heartbeat(1)]
    for b in beats:
        b.beat(10)
    assert dog.check(read_beats(str(folder / "heartbeat"))) is None
    beats[0].finish(10)  # rank 1 is still in its last step's save: watched
    now[0] = 5
    assert dog.check(read_beats(str(folder / "heartbeat"))) is None
    now[0] = 16
    assert "rank-1 after step 10" in (dog.check(read_beats(str(folder / "heartbeat"))) or "")
    beats[1].finish(10)  # both loops ended: nothing is stalled however long the exit takes
    for now[0] in (17, 100, 1000):
        assert dog.check(read_beats(str(folder / "heartbeat"))) is None


def test_rank_hung_before_its_first_step_is_killed_after_the_startup_timeout_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LMYARD_FAULTS", "hang_before@1")  # the last rank never starts step 1, so rank 0 waits too
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    startup_s = (
        60  # more than a healthy start takes here, on a busy 2-core machine too (~37 s), so the kill is the timeout's
    )
    cfg = _cfg(tmp_path, **{"launch.startup_timeout_s": startup_s, "launch.retries": 0})
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    seen, on_line = _first_seen("injected hang", "watchdog:")

    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"watchdog: rank-0, rank-1 completed no training step") as info:
        run_local(cfg, spec, on_line=on_line)
    assert f"launch.startup_timeout_s={startup_s}" in str(info.value) and "\n" not in str(info.value)  # one line
    assert str(info.value).endswith("; run the same command again to resume from the last checkpoint")  # no retry
    assert "injected hang" in seen, "the fault did not fire: the test proves nothing"
    assert startup_s <= seen["watchdog:"] - started < startup_s + 15  # from the job's start, + polling and kill slack
    assert complete_steps(Run("smoke", open_store(cfg.store))) == []
    assert _ranks_of(tmp_path) == [], "a killed job left ranks running"


def test_flow_retries_the_killed_training_task_and_finishes(prefect_api_url, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pretrain import pretrain

    monkeypatch.setenv("LMYARD_FAULTS", "hang@6")
    monkeypatch.setenv("LMYARD_FAULTS_STATE", str(tmp_path / "faults"))
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    state = pretrain(config=_cfg(tmp_path), return_state=True)
    assert state.is_completed() and state.result().steps == 12
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    train = [r for r in runs if r.name.startswith("train")]
    assert len(train) == 1 and train[0].run_count == 2 and train[0].state.is_completed()
