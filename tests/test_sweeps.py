"""`lmyard sweep`: model sizes and search spaces, each trial an ordinary lineage under the sweep's MLflow run.

Against a real MLflow server, a real Prefect server and (for Ray Tune) a real two-node Ray cluster on 127.0.0.1.
The size sweep runs once for the module; its rerun is the resume test.
"""

from __future__ import annotations

import json
import math
import subprocess
import uuid

import pytest
from conftest import lmyard_cmd, tiny_overrides
from mlflow.tracking import MlflowClient

TIMEOUT_S = 1800  # three or four tiny lineages, each a whole pretrain flow, on a busy 2-core machine


def _sets(tmp_path, tracking_uri: str, run_name: str, steps: int, **extra) -> list[str]:
    values = {
        "run_name": run_name,
        "tracking.uri": tracking_uri,
        "tracking.experiment": run_name,
        "model.n_embd": 32,
        "model.n_head": 2,
        "launch.nproc_per_node": 1,
        "eval.interval": 1,
        "eval.val_tokens": 512,
        "checkpoint.interval": steps,
        **extra,
    }
    return [a for s in tiny_overrides(tmp_path, steps=steps, **values) for a in ("--set", s)]


def _runs(uri: str, experiment: str) -> tuple[object, list]:
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("lmyard.sweep") == experiment]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return parents[0], sorted(children, key=lambda r: r.info.run_name)


@pytest.fixture(scope="module")
def size_sweep(tmp_path_factory, mlflow_server, prefect_api_url):
    """`lmyard sweep smoke --sizes 1,2,3` of a 2-step model once; the command, its folder, environment, result."""
    import os

    tmp = tmp_path_factory.mktemp("sizes")
    name = f"sizes-{uuid.uuid4().hex[:6]}"
    sets = _sets(tmp, mlflow_server.uri, name, steps=2, **{"eval.interval": 2})  # one evaluation: the last step's
    args = lmyard_cmd("sweep", "smoke", "--sizes", "1,2,3", *sets)
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "LMYARD_CACHE": str(tmp / "cache")}
    env.pop("PREFECT_HOME", None)
    proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return name, args, tmp, env, proc


@pytest.mark.integration
def test_a_size_sweep_trains_each_size_as_a_child_run_and_fits_loss_against_compute(size_sweep, mlflow_server):
    name, _, _, _, proc = size_sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parent, children = _runs(mlflow_server.uri, name)
    assert [c.info.run_name for c in children] == [f"{name}-x1", f"{name}-x2", f"{name}-x3"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert [c.data.params["model.n_embd"] for c in children] == ["32", "64", "96"]  # width = base * index
    assert [c.data.params["model.n_head"] for c in children] == ["2", "4", "6"]
    assert [c.data.params["model.n_layer"] for c in children] == ["2", "2", "2"]  # depth fixed
    assert parent.info.status == "FINISHED"
    assert "| trial |" in parent.data.tags["mlflow.note.content"]  # the trials' table on the parent run's page
    assert math.isfinite(parent.data.metrics["sweep/power_law_exponent"])
    client = MlflowClient(mlflow_server.uri)
    table = json.loads(open(client.download_artifacts(parent.info.run_id, "trials.json")).read())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [r["trial"] for r in rows] == [c.info.run_name for c in children]
    assert all(r["status"] == "finished" and r["step"] == 2 for r in rows)
    assert rows[0]["flops"] < rows[1]["flops"] < rows[2]["flops"]  # 6ND: N grows with the width
    assert "loss_vs_compute.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    assert not client.search_registered_models(f"name LIKE '{name}%'")  # trials register no model by default


@pytest.mark.integration
def test_a_rerun_sweep_skips_its_finished_trials(size_sweep, mlflow_server):
    name, args, tmp, env, first = size_sweep
    assert first.returncode == 0, first.stderr[-3000:]
    proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3 of 3 trials done already, 0 to train" in proc.stdout + proc.stderr
    _, children = _runs(mlflow_server.uri, name)  # still one parent run
    assert [c.data.tags["lmyard.attempts"] for c in children] == ["1", "1", "1"]  # no trial launched again


@pytest.mark.integration
def test_an_isoflop_sweep_prints_the_recommended_size_of_its_budget_and_fits_no_exponent_through_one(
    tmp_path, mlflow_server, cli_env
):
    # 3e9 FLOPs = 6 N D: 13 steps of 1,024 tokens at x1 (~37k parameters), 5 at x2, 2 at x3
    name, extra = f"iso-{uuid.uuid4().hex[:6]}", {"eval.interval": 1000, "checkpoint.interval": 1000}
    sets = _sets(tmp_path, mlflow_server.uri, name, steps=2, **extra)
    args = lmyard_cmd("sweep", "smoke", "--sizes", "1,2,3", "--budgets", "3e9", *sets)
    proc = subprocess.run(args, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("lmyard: C=3e+09 FLOPs: recommended size")]
    assert len(said) == 1 and "nearest trained size x" in said[0], proc.stdout[-3000:]
    assert "lmyard: no power law: " in proc.stdout and "a power law needs 3, no exponent fitted" in proc.stdout
    parent, children = _runs(mlflow_server.uri, name)
    steps = [int(c.data.params["train.max_steps"]) for c in children]
    assert [c.info.run_name for c in children] == [f"{name}-x{i}-c3e09" for i in (1, 2, 3)]
    assert steps[0] > steps[1] > steps[2] >= 1, steps  # one budget: the smaller model, the more steps
    assert "sweep/optimal_params_exponent" not in parent.data.metrics  # one budget: no exponent logged
    assert "Compute-optimal size:" in parent.data.tags["mlflow.note.content"]
    client = MlflowClient(mlflow_server.uri)
    assert "loss_vs_compute.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]


@pytest.mark.integration
def test_a_tune_search_on_ray_stops_a_bad_trial_before_its_last_step(ray_cluster, mlflow_server, cli_env, tmp_path):
    from lmyard.sweep.record import STOPPED_TAG

    # 120 steps: the 112 after the first rung give a stop time to land (1-2 s here; a poll of 2 s, then SIGTERM)
    steps, name = 120, f"search-{uuid.uuid4().hex[:6]}"
    (tmp_path / "space.yaml").write_text(
        "params:\n  train.lr: {grid: [0.01, 0.005, 1.0e-7, 1.0e-8]}\n"
        "scheduler: {asha: {grace_steps: 8, reduction_factor: 2}}\n"
    )
    on_ray = {"launch.backend": "ray", "launch.nnodes": 1, "eval.interval": 8}
    sets = _sets(tmp_path, mlflow_server.uri, name, steps=steps, **on_ray)
    args = lmyard_cmd("sweep", "smoke", "--search", "space.yaml", *sets)
    env = {**cli_env, "RAY_ADDRESS": ray_cluster.address}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, children = _runs(mlflow_server.uri, name)
    assert len(children) == 4
    client = MlflowClient(mlflow_server.uri)
    last = {
        c.info.run_name: max(m.step for m in client.get_metric_history(c.info.run_id, "loss/val")) for c in children
    }
    stopped = {c.info.run_name: int(c.data.tags[STOPPED_TAG]) for c in children if STOPPED_TAG in c.data.tags}
    # the tag is the scheduler's decision at a rung (8, 16, 32, ...): two trials run at once on the 2 CPUs, so
    # the second pair meets the first pair's recorded losses, and lr 1e-7 or 1e-8 is worse at a rung
    assert any(at < steps for at in stopped.values()), (last, stopped)
    # and the trial's process ran on only until its SIGTERM landed: it did not train to its end
    assert any(last[n] < steps for n in stopped), (last, stopped)
    assert any(c.info.status == "FINISHED" and last[c.info.run_name] == steps for c in children), last


@pytest.mark.parametrize(
    "space, named",
    [
        ("params:\n  train.lrr: {grid: [0.1]}\n", "params.train.lrr: no such config key"),
        ("params:\n  train.lr: {choice: []}\n", "params.train.lr: choice needs a non-empty list"),
        ("params:\n  train.lr: {normal: [0, 1]}\n", "params.train.lr: give one distribution"),
    ],
)
def test_a_bad_search_space_is_one_line_and_exit_2_before_anything_starts(tmp_path, space, named):
    (tmp_path / "space.yaml").write_text(space)
    args = lmyard_cmd("sweep", "smoke", "--search", "space.yaml", "--set", f"store={tmp_path / 'store'}")
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmyard: error: --search space.yaml: {named}"), lines
    assert not (tmp_path / "store").exists()  # no shard, no run


def _refused_sweep(tmp_path, *args: str) -> str:
    """`lmyard sweep smoke ARGS` on a fresh store and sqlite tracking: it must exit 2 with one line on stderr and
    leave no shard, no MLflow run and no flow output; that line."""
    store, db = tmp_path / "store", tmp_path / "mlflow.db"
    sets = ["--set", f"store={store}", "--set", f"tracking.uri=sqlite:///{db}"]
    proc = subprocess.run(
        lmyard_cmd("sweep", "smoke", *args, *sets), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert not store.exists() and not db.exists() and proc.stdout == ""  # no shard, no MLflow run, no flow
    return lines[0]


def test_a_size_whose_checkpoints_cannot_fit_is_one_line_naming_the_trial_before_any_shard_or_run(tmp_path):
    line = _refused_sweep(tmp_path, "--sizes", "1,1000000")
    assert line.startswith("lmyard: error: trial smoke-x1000000 (model.n_embd="), line
    assert "checkpoints do not fit" in line and "MiB needed" in line


def test_budgets_alone_plan_each_budgets_sizes_and_one_too_small_is_one_line_before_any_shard_or_run(tmp_path):
    line = _refused_sweep(tmp_path, "--budgets", "1e8", "--tokens-per-param", "80")
    assert line.startswith("lmyard: error: --budgets 1e+08: the size its sizes centre on, sqrt(C/480)"), line
    assert "give budgets of at least" in line


@pytest.mark.integration
def test_a_trial_that_fails_for_a_user_error_ends_the_sweep_with_exit_2_in_one_line_naming_it(cli_env, tmp_path):
    (tmp_path / "space.yaml").write_text("params:\n  train.lr: {grid: [0.01]}\n")
    name = f"userr-{uuid.uuid4().hex[:6]}"
    sets = _sets(
        tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", name, steps=2, **{"model.init_from": "models:/nope/1"}
    )
    proc = subprocess.run(
        lmyard_cmd("sweep", "smoke", "--search", "space.yaml", *sets),
        cwd=tmp_path,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lmyard: error: trial {name}-t00 failed (exit 2): lmyard: error: model.init_from"), last
    assert "no such registered model version" in last and "Traceback" not in proc.stdout + proc.stderr
    assert (tmp_path / "cache" / "sweeps" / name / f"{name}-t00.log").exists()  # the trial's whole output kept


@pytest.mark.parametrize(
    "api_url, addresses, refused",
    [
        (None, ["10.0.0.1", "10.0.0.2"], True),  # lmyard's temporary server, on this machine's loopback
        ("http://localhost:4200/api", ["10.0.0.1", "10.0.0.2"], True),
        ("http://127.0.0.1:4200/api", ["10.0.0.1"], False),  # a one-host cluster reaches it
        ("http://10.0.0.1:4200/api", ["10.0.0.1", "10.0.0.2"], False),
    ],
)
def test_a_loopback_prefect_api_is_refused_only_when_trials_may_run_on_other_hosts(api_url, addresses, refused):
    from lmyard.sweep.tune import prefect_unreachable

    nodes = [{"NodeManagerAddress": a, "Alive": True} for a in addresses]
    nodes.append({"NodeManagerAddress": "10.0.0.9", "Alive": False})  # a dead node runs no trial
    why = prefect_unreachable(api_url, {"127.0.0.1", "10.0.0.1"}, nodes)
    assert (why is not None) == refused, why
    assert why is None or (why.startswith("PREFECT_API_URL ") and "(10.0.0.2)" in why and "10.0.0.9" not in why)


def test_trials_register_no_model_unless_the_sweep_sets_tracking_registry(tmp_path):
    from lmyard.recipes import load_recipe
    from lmyard.sweep.space import Trial, trial_config

    trial = Trial("t-x2", {"model.n_embd": 64}, 2)
    default = trial_config(load_recipe("smoke", tiny_overrides(tmp_path)), trial)
    assert default["tracking"]["registry"] is False
    asked = trial_config(load_recipe("smoke", [*tiny_overrides(tmp_path), "tracking.registry=true"]), trial)
    assert asked["tracking"]["registry"] is True


def test_the_loss_against_compute_plot_holds_every_point_inside_its_axes():
    """Three trials whose losses span less than a decade (matplotlib's own log limits put them on the frame)."""
    from lmyard.sweep.record import _plot

    class Figures:  # the figure is the subject here, not where MLflow stores it
        def log_figure(self, run_id, fig, name):
            self.fig = fig

    rows = [{"flops": 1e9 * i, "val_loss": 5.6 - 0.3 * i} for i in (1, 2, 3)]
    figures = Figures()
    _plot(figures, "run", rows, a=9.0, b=-0.03)
    (ax,) = figures.fig.axes
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    for line in ax.get_lines():
        for x, y in zip(line.get_xdata(), line.get_ydata()):
            assert x0 < x < x1 and y0 < y < y1, (x, y, ax.get_xlim(), ax.get_ylim())
    figures.fig.canvas.draw()  # and every tick label inside the figure, none cut at its edge
    width = figures.fig.bbox.width
    labels = [t for t in [*ax.get_yticklabels(minor=True), *ax.get_yticklabels()] if t.get_text()]
    assert labels and all(0 <= t.get_window_extent().x0 and t.get_window_extent().x1 <= width for t in labels)


def test_a_trial_whose_step_cannot_fit_the_gpus_is_one_line_naming_it_and_what_would_fit(tmp_path, monkeypatch):
    """The memory plan each trainer makes before its first step, made for every trial before any shard: on GPUs of
    2 GiB (this machine's GPU query, nvidia-smi, is what the test is not about), 12 blocks of width 768 at 32
    sequences of 1,024 a micro-step fit with a smaller micro-batch, and twice that width fits under no setting."""
    from lmyard.errors import UserError
    from lmyard.recipes import load_recipe
    from lmyard.sweep import driver

    sets = [*tiny_overrides(tmp_path), "train.device=cuda", "launch.nproc_per_node=1", "train.micro_batch=32",
            "model.block_size=1024", "train.batch_tokens=32768", "tokenizer.name=bytes", "model.n_layer=12",
            "model.n_embd=768", "model.n_head=12"]  # fmt: skip
    config = load_recipe("smoke", sets)
    monkeypatch.setattr(driver, "local_gpu_bytes", lambda: 2 << 30)
    for size, says in ((1, "it would fit with train.micro_batch="), (2, "nothing tried fits")):
        with pytest.raises(UserError) as refused:
            driver.plan(config, [size], None)
        said = str(refused.value)
        assert said.startswith(f"trial smoke-x{size} (model.n_embd=") and "\n" not in said, said
        assert "will not fit" in said and says in said, said
    monkeypatch.setattr(driver, "local_gpu_bytes", lambda: 80 << 30)
    assert [t["name"] for t in driver.plan(config, [1], None).trials] == ["smoke-x1"]
    monkeypatch.setattr(driver, "local_gpu_bytes", lambda: None)  # no GPU here: nothing to plan against
    assert len(driver.plan(config, [1, 2], None).trials) == 2
