"""`lmyard sweep` before anything starts: a bad search space, a size or budget that cannot fit and a trial whose step
cannot fit the GPUs are one line and exit 2; a loopback Prefect API is refused only where trials may run on other
hosts; trials register no model unless asked; the loss against compute plot holds every point (the sweeps that
train: tests/integration/test_sweeps_integration.py)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import lmyard_cmd, tiny_overrides


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
