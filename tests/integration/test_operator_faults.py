"""The operator commands under faults: a tracking server that accepts connections and never answers, a lineage
recorded on another server, a store or lineage that is not there, a damaged checkpoint. Each is one line naming
what is wrong, exit 2, in seconds, and leaves nothing behind (no download, no MLflow run, the checkpoint kept).
The stores are local folders with random checkpoints (tests/conftest.py), the tracking a sqlite file or a socket
that never answers: the commands run in this process (flows.cli.main)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import write_random_checkpoint

from flows.cli import main
from lmyard.tracking.client import OPERATOR_TIMEOUTS

pytestmark = pytest.mark.integration  # each loads a model or waits out a timeout: seconds, not milliseconds


@pytest.fixture
def command(monkeypatch, tmp_path, capsys):
    """flows.cli.main in this process, its MLflow timeouts and cache undone after the test: (code, stdout, stderr)."""
    for key in [*OPERATOR_TIMEOUTS, "MLFLOW_LOGGING_LEVEL", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"]:
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


@pytest.fixture
def lineage_store(tmp_path) -> Path:
    """A store whose lineage r holds complete checkpoints 3 and 5, recorded as MLflow run `0f0f...` (on no server)."""
    store = tmp_path / "store"
    write_random_checkpoint(store, step=3)
    write_random_checkpoint(store, step=5)
    (store / "runs/r/lineage.json").write_text(json.dumps({"mlflow_run_id": RUN_ID}))
    return store


RUN_ID = "0f" * 16
SILENT = [
    ("status", "r"),
    ("eval", "models:/smoke/1"),
    ("sample", "models:/smoke/1", "--prompt", "x"),
    ("eval", "r", "--log"),
]


@pytest.mark.parametrize("args", SILENT, ids=[" ".join(a[:2]) + (" --log" if "--log" in a else "") for a in SILENT])
def test_a_tracking_server_that_never_answers_is_one_line_within_15_s(
    lineage_store, silent_server, command, tmp_path, args
):
    start = time.monotonic()
    err = _one_line(*command(*args, "--store", str(lineage_store), "--tracking-uri", silent_server))
    assert time.monotonic() - start < 15
    assert f"tracking.uri {silent_server}: the MLflow server does not answer within 5 s (ReadTimeout)" in err
    assert "start it, or point tracking.uri (--tracking-uri) at a running server" in err
    assert not (tmp_path / "cache").exists()  # nothing downloaded, no model read


def test_status_with_a_tracking_uri_that_does_not_hold_the_lineage_is_one_line(
    lineage_store, command, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")  # the default tracking URI
    err = _one_line(*command("status", "r", "--store", str(lineage_store)))
    assert f"lineage r's MLflow run {RUN_ID} is not there" in err
    assert "give --tracking-uri (or LMYARD_TRACKING__URI) the MLflow server the lineage was recorded on" in err
    assert sorted(p.name for p in (lineage_store / "runs/r/checkpoints").iterdir()) == [
        "step_00000003",
        "step_00000005",
    ]  # read, nothing changed


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
