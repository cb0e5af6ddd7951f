"""lmyard.console: what `lmyard run` prints for a person (records as Prefect's loggers make them; no services)."""

from __future__ import annotations

import io
import logging
import os

from lmyard import console


def _record(message: str, level: int = logging.INFO, logger: str = "prefect.task_runs", **extra) -> logging.LogRecord:
    record = logging.LogRecord(logger, level, __file__, 1, message, None, None)
    record.__dict__.update(extra)
    return record


def test_a_task_line_names_the_task_once_and_paths_relative_to_the_store(tmp_path):
    c = console.Console(str(tmp_path / "store"), io.StringIO())
    line = c.line(
        _record(
            f"checkpoint step 25 committed -> {tmp_path}/store/runs/smoke/checkpoints/step_00000025",
            task_name="train",
            task_run_name="train-6b9",
        )
    )
    assert line.endswith(" train: checkpoint step 25 committed -> runs/smoke/checkpoints/step_00000025")
    assert "INFO" not in line and str(tmp_path) not in line
    named = c.line(
        _record("step 100: val loss 2.1", task_name="evaluate-checkpoint", task_run_name="evaluate-step-100")
    )
    assert " evaluate-step-100: step 100" in named


def test_a_warning_says_warning_once():
    c = console.Console("/s", io.StringIO())
    assert c.line(_record("warning: data repeats", logging.WARNING)).count("warning:") == 1
    assert c.line(_record("data repeats", logging.WARNING)).count("warning:") == 1
    assert "\x1b[" not in c.line(_record("\x1b[33mcolored\x1b[0m", logging.WARNING))


def test_chatter_is_left_out_and_errors_are_not():
    c = console.Console("/s", io.StringIO())
    assert c.line(_record("Starting temporary server on http://127.0.0.1:8000", logger="prefect")) is None
    assert c.line(_record("Finished in state Completed()", task_name="train", task_run_name="train-6b9")) is None
    assert c.line(_record("Creating initial MLflow database tables...", logger="mlflow.store.db.utils")) is None
    assert c.line(_record("Finished in state Failed('x')", logging.ERROR, task_name="t", task_run_name="t-abc"))


def test_a_sample_prints_as_text_on_indented_lines():
    c = console.Console("/s", io.StringIO())
    text = console.sample_text(100, "Exceptions are", " raised\nby the code.\n\nThe value")
    line = c.line(_record(text, task_name="evaluate-checkpoint", task_run_name="evaluate-step-100"))
    lines = line.splitlines()
    assert "\\n" not in line and len(lines) == 5
    assert lines[1].strip() == "| Exceptions are raised" and lines[2].strip() == "| by the code."


def test_progress_draws_a_bar_with_an_eta_on_a_terminal_only():
    plain = io.StringIO()
    console.Console("/s", plain, bars=False).progress("train", 10, 50, "loss 3.2")
    assert plain.getvalue() == ""
    tty = io.StringIO()
    c = console.Console("/s", tty, bars=True)
    c.progress("train", 10, 50, "loss 3.2")
    c.progress("train", 20, 50, "loss 3.0")
    drawn = tty.getvalue()
    assert "20/50" in drawn and "<" in drawn and "loss 3.0" in drawn  # elapsed<remaining: the ETA
    c.write("a line printed meanwhile")
    assert "a line printed meanwhile" in tty.getvalue()
    c.progress("train", 50, 50)
    assert not c._bars  # a finished bar is closed


def test_the_last_line_names_the_mlflow_ui_and_the_model():
    local = console.where_next("sqlite:///.lmyard/mlflow.db", "abc", "smoke/1")
    assert "mlflow ui --backend-store-uri sqlite:///.lmyard/mlflow.db" in local and "models:/smoke/1" in local
    remote = console.where_next("https://user:secret@mlflow.internal", "abc", None)
    assert "secret" not in remote and "mlflow.internal" in remote and "abc" in remote


def test_the_last_lines_mlflow_is_the_one_beside_lmyards_python_as_this_shell_calls_it(tmp_path, monkeypatch):
    import sys

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").touch()
    (bin_dir / "mlflow").write_text("#!/bin/sh\n")
    (bin_dir / "mlflow").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the virtualenv not activated: `.venv/bin/lmyard run smoke`
    line = console.where_next("sqlite:///.lmyard/mlflow.db", "abc", "smoke/1")
    assert line.startswith("look at it: .venv/bin/mlflow ui --backend-store-uri sqlite:///.lmyard/mlflow.db;"), line
    monkeypatch.chdir(bin_dir)
    assert console.mlflow_command() == "./mlflow"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert console.mlflow_command() == str(bin_dir / "mlflow")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # activated
    assert console.mlflow_command() == "mlflow"
    (bin_dir / "mlflow").unlink()  # no mlflow beside it: the one on PATH, if any
    assert console.mlflow_command() == "mlflow"


def test_installed_libraries_warnings_are_filtered_and_lmyards_are_not():
    """In a process of its own: install() changes the process's logging and warning filters."""
    import subprocess
    import sys

    code = (
        "import os, warnings, mlflow, lmyard\n"
        "from lmyard import console\n"
        "console.install('/s')\n"
        "theirs = os.path.join(os.path.dirname(mlflow.__file__), 'pyfunc', '__init__.py')\n"
        "ours = os.path.join(os.path.dirname(lmyard.__file__), 'train', 'distributed', 'parallel.py')\n"
        "warnings.warn_explicit('from mlflow', UserWarning, theirs, 1, module='mlflow.pyfunc')\n"
        "warnings.warn_explicit('from lmyard', UserWarning, ours, 1, module='lmyard.train.distributed.parallel')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "from lmyard" in done.stderr and "from mlflow" not in done.stderr


def test_lmyard_run_and_shard_default_to_smoke_as_their_help_says():
    from flows.cli import _parser

    for command in ("run", "shard", "config"):
        assert _parser().parse_args([command]).recipe == "smoke"
    assert "`smoke` (CPU default)" in _parser()._subparsers._group_actions[0].choices["run"].format_help()


def test_a_reader_that_stops_early_ends_the_command_without_a_traceback():
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "config", "--reference"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    proc.stdout.close()  # a reader gone before the first line (`| true`; `| head` once it has its lines)
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]


def test_prefects_client_telemetry_is_off_unless_the_operator_turns_it_on(monkeypatch):
    from flows.cli import main

    monkeypatch.delenv("DO_NOT_TRACK", raising=False)
    assert main(["config"]) == 0
    assert os.environ["DO_NOT_TRACK"] == "1"
    monkeypatch.setenv("DO_NOT_TRACK", "0")  # the operator's choice stands
    assert main(["config"]) == 0
    assert os.environ["DO_NOT_TRACK"] == "0"


def test_a_failure_the_run_ends_with_is_left_to_the_last_line():
    """The stage's own line, the task's state, the flow's exception and state all say one failure: the console
    prints none of them when the command line's last line says it."""
    from lmyard.errors import UserError

    out = io.StringIO()
    c = console.Console("/s", out)
    error = UserError("run 'smoke' has checkpoint step 5 of another model (n_embd=32)")
    train = {"task_name": "train", "task_run_name": "train-6b9"}
    c.handle(_record(f"lmyard: error: {error}", **train))
    c.handle(_record("torchrun: rank 1 exited with code 2 (pid 7)", **train))
    c.handle(_record(f"Finished in state Failed('Task run encountered an exception UserError: {error}')", 40, **train))
    flow = {"logger": "prefect.flow_runs", "flow_name": "pretrain"}
    encountered = _record("Encountered exception during execution: %r", 40, error=error, **flow)
    encountered.args = (error,)
    c.handle(encountered)
    c.handle(_record(f"Finished in state Failed('Flow run encountered an exception: UserError: {error}')", 40, **flow))
    c.settle(error)
    assert "another model" not in out.getvalue() and "torchrun: rank 1 exited" in out.getvalue()


def test_a_failure_the_flow_goes_on_from_prints_once_before_the_next_line():
    out = io.StringIO()
    c = console.Console("/s", out)
    evaluate = {"task_name": "evaluate-checkpoint", "task_run_name": "evaluate-step-3"}
    failed = "Finished in state Failed('Task run encountered an exception UserError: no val shard\\nsecond line')"
    c.handle(_record(failed, 40, **evaluate))
    c.handle(_record(failed, 40, **evaluate))
    c.handle(_record("step 4/6 | loss 5.1", task_name="train", task_run_name="train-6b9"))
    c.settle(None)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "Finished in state" not in out.getvalue(), lines
    assert lines[0].endswith("evaluate-step-3: error: failed: no val shard (its last lines are above)")
    assert lines[1].endswith("train: step 4/6 | loss 5.1")


def test_a_retried_attempt_says_its_failure_and_its_retry_in_one_line():
    from lmyard.errors import TrainingFailed

    out = io.StringIO()
    c = console.Console("/s", out)
    retry = _record(
        "Task run failed with %s: %r - Retry %s/%s will start %s", task_name="train", task_run_name="train-6b9"
    )
    retry.args = (
        "exception",
        TrainingFailed("train exited with code 1. Last lines:\na\nb"),
        1,
        2,
        "5 second(s) from now",
    )
    c.handle(retry)
    assert (
        out.getvalue()
        .rstrip("\n")
        .endswith(
            "train: failed: train exited with code 1 (its last lines are above); retry 1/2 starts 5 second(s) from now"
        )
    )
    assert out.getvalue().count("\n") == 1
