"""`python -m lmyard.stages` and `python -m lmyard.evaluate`: results and failures come back as files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, tiny_overrides

from lmyard.contracts import EvalResult, ShardResult, StageError, read_model
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import StageFailed, UserError
from lmyard.launch.follower import run_local
from lmyard.recipes import load_recipe

pytestmark = pytest.mark.slow


def _stage(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "lmyard.stages", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )


def _sets(overrides):
    return [x for o in overrides for x in ("--set", o)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    overrides = tiny_overrides(
        tmp, steps=4, **{"run_name": "staged", "checkpoint.interval": 2, "launch.nproc_per_node": 1}
    )
    cfg = load_recipe("smoke", overrides)
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    run_local(cfg, {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict()}, on_line=lambda s: None)
    return tmp, overrides


def test_shard_stage_writes_its_result_file(trained, monkeypatch):
    tmp, overrides = trained
    done = _stage("shard", "smoke", *_sets(overrides), "--out", str(tmp / "shard.json"))
    assert done.returncode == 0, done.stderr
    result = read_model(str(tmp / "shard.json"), ShardResult)
    assert result.reused and result.train_tokens > 10_000 and result.uri.endswith(result.address)


def test_evaluate_stage_scores_the_newest_checkpoint_or_a_given_step(trained):
    tmp, overrides = trained
    done = _stage("evaluate", "smoke", *_sets(overrides), "--out", str(tmp / "eval.json"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    newest = read_model(str(tmp / "eval.json"), EvalResult)
    assert newest.step == 4 and newest.checkpoint.endswith("step_00000004") and newest.val_loss > 0
    assert newest.val_loss == pytest.approx(newest.trainer_val_loss, rel=1e-6)
    done = _stage("evaluate", "smoke", *_sets(overrides), "--step", "2", "--out", str(tmp / "eval2.json"))
    assert done.returncode == 0 and read_model(str(tmp / "eval2.json"), EvalResult).step == 2


def test_a_failing_stage_writes_its_error_and_exits_with_its_code(trained):
    tmp, overrides = trained
    done = _stage(
        "evaluate", "smoke", *_sets(overrides), "--set", "run_name=never-trained", "--out", str(tmp / "failed.json")
    )
    assert done.returncode == 2
    failure = read_model(str(tmp / "failed.json"), StageError)
    assert failure.status == "user_error" and "has no complete checkpoint" in failure.message
    assert "Traceback" not in done.stderr


def test_the_evaluate_task_reads_the_evaluators_result_and_errors_from_files(trained):
    from tasks.evaluate import _run_evaluator

    tmp, overrides = trained
    cfg = load_recipe("smoke", overrides)
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    assert _run_evaluator(cfg, shards, 2)["step"] == 2
    with pytest.raises(UserError, match="no GPU is visible; set eval.device=cpu"):
        _run_evaluator(load_recipe("smoke", [*overrides, "eval.device=cuda:0"]), shards, 2)


def test_a_stage_that_dies_without_a_result_is_a_crash_with_its_last_lines(tmp_path):
    from lmyard.contracts import read_stage_result

    with pytest.raises(StageFailed, match="exited with code 1 without writing .*last lines:\nboom"):
        read_stage_result(str(tmp_path / "none.json"), EvalResult, 1, "boom")
    (tmp_path / "err.json").write_text(json.dumps({"status": "diverged", "exit_code": 3, "message": "nan"}))
    from lmyard.errors import Diverged

    with pytest.raises(Diverged, match="nan"):
        read_stage_result(str(tmp_path / "err.json"), EvalResult, 3)
