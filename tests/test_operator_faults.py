"""The operator commands under faults: a tracking server that accepts connections and never answers, a lineage
recorded on another server, a store or lineage that is not there, a damaged checkpoint. Each is one line naming
what is wrong, exit 2, in seconds, and leaves nothing behind (no download, no MLflow run, the checkpoint kept)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import write_random_checkpoint

from flows.cli import main
from lmyard.tracking.client import OPERATOR_TIMEOUTS


@pytest.fixture
def command(monkeypatch, tmp_path, capsys):
    """flows.cli.main in this process, its MLflow timeouts and cache undone after the test: (code, stdout, stderr)."""
    for key in OPERATOR_TIMEOUTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def _one_line(code: int, out: str, err: str) -> str:
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith("lmyard: error: "), err
    assert "Traceback" not in err
    return err


SILENT = [
    ("status", "smoke"),
    ("eval", "models:/smoke/1"),
    ("sample", "models:/smoke/1", "--prompt", "x"),
    ("eval", "smoke", "--log"),
]


@pytest.mark.parametrize("args", SILENT, ids=[" ".join(a[:2]) + (" --log" if "--log" in a else "") for a in SILENT])
def test_a_tracking_server_that_never_answers_is_one_line_within_15_s(
    finished_run, silent_server, command, tmp_path, args
):
    _, store, _ = finished_run
    start = time.monotonic()
    err = _one_line(*command(*args, "--store", store, "--tracking-uri", silent_server))
    assert time.monotonic() - start < 15
    assert f"tracking.uri {silent_server}: the MLflow server does not answer" in err and "start it" in err
    assert not (tmp_path / "cache").exists()  # nothing downloaded, no model read


def test_status_with_a_tracking_uri_that_does_not_hold_the_lineage_is_one_line(
    finished_run, command, tmp_path, monkeypatch
):
    _, store, _ = finished_run
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")  # the default tracking URI
    err = _one_line(*command("status", "smoke", "--store", store))
    assert "lineage smoke's MLflow run" in err and "is not there" in err
    assert "give --tracking-uri (or LMYARD_TRACKING__URI) the MLflow server the lineage was recorded on" in err


@pytest.mark.parametrize(
    "args, says",
    [
        (("runs",), "does not exist: give --store (or LMYARD_STORE)"),
        (("status", "smoke"), "does not exist: give --store (or LMYARD_STORE)"),
        (("eval", "smoke"), "no lineage 'smoke'"),
        (("sample", "smoke", "--prompt", "x"), "no lineage 'smoke'"),
    ],
    ids=["runs", "status", "eval", "sample"],
)
def test_a_store_that_does_not_exist_is_one_line(command, tmp_path, args, says):
    missing = tmp_path / "no-such-store"
    err = _one_line(*command(*args, "--store", str(missing)))
    assert says in err and str(missing) in err
    assert not missing.exists() and not (tmp_path / "cache").exists()


@pytest.fixture
def damaged_store(tmp_path) -> Path:
    """A store whose lineage r holds complete checkpoints 3 and 5; 5's model file is truncated."""
    store = tmp_path / "store"
    write_random_checkpoint(store, step=3)
    write_random_checkpoint(store, step=5)
    model_pt = store / "runs/r/checkpoints/step_00000005/model.pt"
    model_pt.write_bytes(model_pt.read_bytes()[:-100])
    return store


@pytest.mark.parametrize("args", [("eval", "r"), ("sample", "r", "--prompt", "x")], ids=["eval", "sample"])
def test_a_damaged_checkpoint_is_named_with_the_complete_steps_and_kept(command, damaged_store, tmp_path, args):
    err = _one_line(*command(*args, "--store", str(damaged_store)))
    assert "runs/r/checkpoints/step_00000005 is damaged (" in err
    assert "give another step with --step (complete steps: [3, 5])" in err
    assert (damaged_store / "runs/r/checkpoints/step_00000005/manifest.json").exists()  # read, never moved


def test_status_marks_a_damaged_newest_checkpoint(command, damaged_store):
    code, out, err = command("status", "r", "--store", str(damaged_store))
    assert code == 0, err
    (newest,) = [ln for ln in out.splitlines() if "newest checkpoint:" in ln]
    assert newest.rstrip().endswith(")") and "step_00000005 DAMAGED (" in newest and "bytes" in newest
