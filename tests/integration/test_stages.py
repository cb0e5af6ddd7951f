"""The stage protocol: `python -m lmyard.stages STAGE --spec`, run through the one launcher; results and failures
come back as typed files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, lmyard_cmd, tiny_overrides

from lmyard.errors import Diverged, StageFailed, TrainingFailed, UserError
from lmyard.launch.follower import Follower
from lmyard.launch.launcher import launch
from lmyard.launch.local_job import LocalJob
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.stages import (
    EvalResult,
    EvalSpec,
    ExportResult,
    ExportSpec,
    ShardResult,
    ShardSpec,
    StageError,
    TrainResult,
    TrainSpec,
    read_model,
    read_result,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 4 steps (checkpoints 2 and 4), every stage launched like the flow launches it."""
    tmp = tmp_path_factory.mktemp("stages")
    overrides = tiny_overrides(
        tmp, steps=4, **{"run_name": "staged", "checkpoint.interval": 2, "launch.nproc_per_node": 1}
    )
    cfg = load_recipe("smoke", overrides)
    sharded = launch(ShardSpec(config=cfg), on_line=lambda s: None)
    result = launch(TrainSpec(config=cfg, shards=sharded.shards), on_line=lambda s: None)
    assert isinstance(result, TrainResult) and result.step == 4
    return tmp, cfg, sharded


def test_shard_stage_returns_the_shard_set_and_reuses_it(trained):
    tmp, cfg, first = trained
    assert isinstance(first, ShardResult) and not first.reused and first.train_tokens > 10_000
    again = launch(ShardSpec(config=cfg), on_line=lambda s: None)
    assert again.reused and again.shards == first.shards and again.shards.uri.endswith(again.shards.address)


def test_evaluate_stage_scores_the_newest_checkpoint_or_a_given_step(trained):
    _, cfg, sharded = trained
    newest = launch(EvalSpec(config=cfg, shards=sharded.shards), on_line=lambda s: None)
    assert isinstance(newest, EvalResult)
    assert newest.step == 4 and newest.checkpoint.endswith("step_00000004") and newest.val_loss > 0
    assert newest.val_loss == pytest.approx(newest.trainer_val_loss, rel=1e-6)
    assert launch(EvalSpec(config=cfg, shards=sharded.shards, step=2), on_line=lambda s: None).step == 2


def test_an_evaluation_from_an_installed_package_reaches_mlflow_the_prefect_table_and_status(
    trained, monkeypatch, mlflow_server, prefect_api_url
):
    """tests/fixtures/example_evaluation: one module and one entry point make a new evaluation; the evaluate
    task runs it in the stage beside the built-in ones, its metric lands on the lineage's run at the checkpoint's
    step, its rows in the Prefect table and in `lmyard status`, as the built-ins' do."""
    from mlflow.tracking import MlflowClient
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from lmyard.evaluate.spec import as_text
    from lmyard.tracking.lineage import Lineage
    from tasks.evaluate import evaluate_checkpoint

    _, staged, sharded = trained
    cfg = staged.model_copy(update={"tracking": staged.tracking.model_copy(update={"uri": mlflow_server.uri})})
    plugin = str(REPO / "tests" / "fixtures" / "example_evaluation")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [plugin, os.environ.get("PYTHONPATH")])))
    lineage = Lineage.open(cfg, Run.of(cfg), shard_address=sharded.shards.address, code_version="test")

    @flow(name="evaluate-with-a-plugin")
    def evaluate_step_2():
        return evaluate_checkpoint(cfg, sharded.shards, lineage, 2)

    result = evaluate_step_2().result
    assert result.metrics["eval/vocab_size"] == 320 and 0 <= result.metrics["eval/letter_after_space"] <= 1
    assert result.metrics["loss/eval"] == result.val_loss  # the built-ins ran too
    share = result.metrics["eval/letter_after_space"]

    history = MlflowClient(cfg.tracking.uri).get_metric_history(lineage.ref.mlflow_run_id, "eval/letter_after_space")
    assert [(m.step, m.value) for m in history] == [(2, share)]
    with get_client(sync_client=True) as pc:
        key = ArtifactFilterKey(any_=["staged-eval-step-00000002"])
        (artifact,) = pc.read_artifacts(artifact_filter=ArtifactFilter(key=key))
    table = {row["what"]: row["value"] for row in json.loads(artifact.data)}
    assert table["eval/letter_after_space"] == as_text(share) and table["eval/vocab_size"] == "320"
    assert table["val loss"] == f"{result.val_loss:.4f}"
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    args = ["status", "staged", "--store", cfg.store, "--tracking-uri", cfg.tracking.uri]
    status = subprocess.run(lmyard_cmd(*args), env=env, capture_output=True, text=True, timeout=300)
    assert status.returncode == 0, status.stderr[-3000:]
    assert f"step 2, val loss {result.val_loss:.4f}" in status.stdout and "eval/vocab_size 320" in status.stdout
    assert f"eval/letter_after_space {table['eval/letter_after_space']}" in status.stdout


def test_export_stage_writes_the_folder_and_returns_where(trained):
    tmp, cfg, _ = trained
    spec = ExportSpec(config=cfg, source=f"{cfg.store}/runs/staged", dest=str(tmp / "hf"))
    result = launch(spec, on_line=lambda s: None)
    assert isinstance(result, ExportResult) and result.step == 4 and result.hf_architecture == "GPT2LMHeadModel"
    assert result.uri == str(tmp / "hf") and (tmp / "hf" / "model.safetensors").exists()


def test_a_failing_stage_raises_the_error_its_exit_code_names_with_its_one_line(trained):
    _, cfg, sharded = trained
    never = cfg.model_copy(update={"run_name": "never-trained"})
    with pytest.raises(UserError, match="has no complete checkpoint"):
        launch(EvalSpec(config=never, shards=sharded.shards), on_line=lambda s: None)
    with pytest.raises(UserError, match="no GPU is visible; set eval.device=cpu"):
        gpu = load_recipe("smoke", [f"store={cfg.store}", "run_name=staged", "eval.device=cuda:0"])
        launch(EvalSpec(config=gpu, shards=sharded.shards, step=2), on_line=lambda s: None)


def test_the_command_line_reads_its_spec_and_writes_its_result_or_its_error(trained):
    tmp, cfg, sharded = trained
    for name, run_name, step in (("ok", "staged", 2), ("failed", "never-trained", None)):
        spec = EvalSpec(config=cfg.model_copy(update={"run_name": run_name}), shards=sharded.shards, step=step)
        (tmp / f"{name}-spec.json").write_text(spec.model_dump_json())
    cmd = [sys.executable, "-m", "lmyard.stages", "evaluate", "--spec"]
    ok = subprocess.run([*cmd, str(tmp / "ok-spec.json"), "--out", str(tmp / "ok.json")], cwd=REPO, timeout=300)
    assert ok.returncode == 0 and read_model(str(tmp / "ok.json"), EvalResult).step == 2
    failed = subprocess.run(
        [*cmd, str(tmp / "failed-spec.json"), "--out", str(tmp / "failed.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    failure = read_model(str(tmp / "failed.json"), StageError)
    assert failure.status == "user_error" and "has no complete checkpoint" in failure.message


def test_jobs_leave_no_folder_in_the_cache_and_remove_those_of_launchers_that_died(tmp_path, monkeypatch):
    """A job's exchange folder goes when the job ends, finished or failed; one left by a launcher that
    was killed goes when the next job starts; a live launcher's stays."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LMYARD_CACHE", str(cache))
    killed = textwrap.dedent(
        f"""
        import os, signal
        from lmyard.stages import ShardSpec
        from lmyard.launch.local_job import LocalJob
        from lmyard.recipes import load_recipe
        cfg = load_recipe("smoke", ["store={tmp_path / "store"}"])
        print(LocalJob(cfg, ShardSpec(config=cfg)).folder, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher dies without closing its job
        """
    )
    env = {**os.environ, "LMYARD_CACHE": str(cache)}
    died = subprocess.run(
        [sys.executable, "-c", killed], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    orphan = died.stdout.strip()
    assert died.returncode == -9 and os.path.isdir(orphan), died.stderr
    cfg = load_recipe("smoke", tiny_overrides(tmp_path))
    live = LocalJob(cfg, ShardSpec(config=cfg))  # this process's own job, not yet started: it stays

    assert isinstance(launch(ShardSpec(config=cfg), on_line=lambda s: None), ShardResult)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="holds no documents"):
        empty = load_recipe("smoke", tiny_overrides(tmp_path, **{"data.source": str(tmp_path / "empty.jsonl")}))
        launch(ShardSpec(config=empty), on_line=lambda s: None)
    assert [p for p in os.listdir(cache) if p.startswith("lmyard-")] == [os.path.basename(live.folder)]
    live.close()
    assert not [p for p in os.listdir(cache) if p.startswith("lmyard-")]


def test_a_result_file_with_a_nonzero_exit_code_is_the_failure_it_names(tmp_path):
    train_failed = TrainResult.ended(3, "loss is nan", step=7).model_dump_json()
    assert read_result(train_failed, TrainResult) == StageError(status="diverged", exit_code=3, message="loss is nan")
    with pytest.raises(Diverged, match="nan"):
        raw = json.dumps({"status": "diverged", "exit_code": 3, "message": "nan"})
        _follow_a_job_that_wrote(raw, tmp_path)


def test_a_stage_that_dies_without_a_result_is_a_crash_with_its_last_lines(tmp_path):
    with pytest.raises(TrainingFailed, match="exited with code 1") as failed:
        _follow_a_job_that_wrote(None, tmp_path, exit_code=1, lines=["boom"])
    assert isinstance(failed.value, StageFailed)
    assert "\n" not in str(failed.value) and failed.value.output == ["boom"]  # one line; its last lines apart


def _follow_a_job_that_wrote(raw: str | None, tmp_path, exit_code: int = 3, lines: tuple = ()):
    """A LocalJob whose process prints `lines`, leaves `raw` as its result file and exits with `exit_code`."""
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}"])
    job = LocalJob(cfg, ShardSpec(config=cfg))
    if raw is not None:
        job.exchange.write("result.json", json.loads(raw))
    script = "".join(f"print({line!r});" for line in lines) + f"raise SystemExit({exit_code})"
    job.cmd = [sys.executable, "-c", script]
    return Follower(job, cfg, on_line=lambda s: None).run()
