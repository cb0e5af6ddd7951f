"""MLflow tracking on a sqlite store (no server): one metric value per step across attempts; evaluations
linked to logged models."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from lmyard.run import Run
from lmyard.tracking.sink import MLflowSink


@pytest.mark.integration
def test_resumed_sink_does_not_log_a_step_twice_and_says_which_attempt_logged_it(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("sink", artifact_location=str(tmp_path / "a"))).info.run_id

    first = MLflowSink(uri, run_id)  # an attempt that reached step 5, then died
    for step in range(1, 6):
        first.log({"loss/train": 10.0 - step}, step)
    first.close()
    second = MLflowSink(uri, run_id)  # resumed from a checkpoint at step 3: repeats 4 and 5, with other timings
    for step in range(4, 9):
        second.log({"loss/train": 100.0 + step, "step_time_s": 0.1}, step)
    second.flush()
    second.log({"loss/train": 0.5}, 8)  # the same step again within one sink is dropped too
    second.log({"system/goodput/wall_s": 1.0}, 8)
    second.flush()
    second.log({"system/goodput/wall_s": 2.0}, 8)  # but a running total's newer record is kept: MLflow's latest
    second.close()

    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss/train")]
    assert sorted(history) == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    # a key the earlier attempt never logged starts where this attempt starts
    assert sorted(m.step for m in client.get_metric_history(run_id, "step_time_s")) == [4, 5, 6, 7, 8]
    assert second.skipped == 3
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "metrics: loss/train at step 4 is already in the MLflow run (an earlier attempt logged it); steps logged "
        "before are not logged again",
        "metrics: loss/train was logged twice at step 8; the first value is kept",
    ]
    assert client.get_run(run_id).data.metrics["system/goodput/wall_s"] == 2.0


@pytest.mark.integration
def test_evaluation_is_logged_at_its_step_and_linked_to_the_checkpoints_logged_model(tmp_path):
    from lmyard.evaluate.history import log_evaluation
    from lmyard.recipes import load_recipe
    from lmyard.stages import EvalResult
    from lmyard.tracking.lineage import Lineage

    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    lineage = Lineage.open(cfg, Run.of(cfg), shard_address="a" * 64, code_version="test")
    ckpt = f"{cfg.store}/runs/smoke/checkpoints/step_00000003"
    log_evaluation(
        lineage,
        EvalResult.model_validate(
            {
                "step": 3,
                "checkpoint": ckpt,
                "tokens_seen": 12288,
                "trainer_val_loss": 2.5,
                "eval_s": 1.0,
                "device": "cpu",
                "scores": {
                    "val_loss": {"metrics": {"loss/eval": 2.5}},
                    "harness": {
                        "metrics": {"task/hellaswag_local/acc": 0.5, "task/hellaswag_local/acc_norm": 0.75},
                        "result": {"metrics": {"hellaswag_local/acc": 0.5, "hellaswag_local/acc_norm": 0.75}},
                    },
                    "samples": {"samples": [{"prompt": "A class is", "completion": " a"}]},
                },
            }
        ),
    )

    client = MlflowClient(cfg.tracking.uri)
    history = client.get_metric_history(lineage.ref.mlflow_run_id, "task/hellaswag_local/acc_norm")
    assert [(m.step, m.value) for m in history] == [(3, 0.75)]
    [model] = client.search_logged_models([lineage.ref.experiment_id])
    assert model.name == "smoke-step-00000003" and model.params == {"checkpoint_uri": ckpt, "step": "3"}
    assert {m.key: (m.step, m.value) for m in model.metrics} == {
        "loss/eval": (3, 2.5),
        "system/eval/seconds": (3, 1.0),
        "task/hellaswag_local/acc": (3, 0.5),
        "task/hellaswag_local/acc_norm": (3, 0.75),
    }
    assert [o.model_id for o in client.get_run(lineage.ref.mlflow_run_id).outputs.model_outputs] == [model.model_id]


def _sqlite_lineage(tmp_path, *overrides: str):
    from lmyard.recipes import load_recipe
    from lmyard.tracking.lineage import Lineage

    cfg = load_recipe(
        "smoke", [f"store={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", *overrides]
    )
    return cfg, Lineage.open(cfg, Run.of(cfg), shard_address="a" * 64, code_version="test")


@pytest.mark.integration
def test_registered_version_is_listed_on_its_logged_model_and_its_alias_resolves(tmp_path, monkeypatch):
    import json

    import mlflow

    from lmyard.tracking import model_registry

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg, lineage = _sqlite_lineage(tmp_path)
    ckpt = f"{cfg.store}/runs/smoke/checkpoints/step_00000004"
    model_id = lineage.log_checkpoint_model(4, ckpt, {"checkpoint": ckpt, "step": 4})
    version = model_registry.register_model(lineage, "tiny", model_id, 4, "tiny at step 4", {"k": "v"}, ckpt)
    assert not mlflow.is_tracking_uri_set(), "registering left the process's global tracking URI set"
    model_registry.set_alias(lineage, "tiny", "candidate", version)

    client = MlflowClient(cfg.tracking.uri)
    # what the MLflow UI reads on the logged model's page ("Model versions"), as mlflow.register_model writes it
    listed = json.loads(client.get_logged_model(model_id).tags["mlflow.modelVersions"])
    assert [(v["name"], str(v["version"])) for v in listed] == [("tiny", version)]
    [found] = client.search_logged_models([lineage.ref.experiment_id], filter_string="name = 'smoke-step-00000004'")
    assert json.loads(found.tags["mlflow.modelVersions"]) == listed
    mv = client.get_model_version("tiny", version)
    assert mv.run_id == lineage.ref.mlflow_run_id and mv.description == "tiny at step 4"
    assert mv.tags["lmyard.checkpoint"] == ckpt and mv.source == f"models:/{model_id}"
    assert client.get_run(lineage.ref.mlflow_run_id).data.tags["lmyard.registered_model"] == f"tiny/{version}"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", cfg.tracking.uri)
    for uri in ("models:/tiny@candidate", "models:/tiny/latest"):  # the README's two ways to name it
        folder = mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / uri.replace("/", "_")))
        with open(f"{folder}/lmyard_checkpoint.json") as f:
            assert json.load(f)["checkpoint"] == ckpt


def test_retention_retires_the_logged_models_of_the_checkpoints_it_deletes(tmp_path, prefect_api_url):
    import torch
    from checkpoint_helpers import save_full

    from lmyard.store import open_store
    from lmyard.tracking.lineage import DELETED_TAG
    from tasks.retention import retain_checkpoints

    cfg, lineage = _sqlite_lineage(tmp_path, "checkpoint.keep_last=2", "checkpoint.keep_best=false")
    store = open_store(cfg.store)
    ids = {}
    for step in (1, 2, 3, 4):
        state = {"step": step, "val_loss": None, "cursor": step, "tokens_seen": step, "world_size": 1}
        state |= {"shard_address": "a", "config": {}, "model": {}}
        uri = save_full(Run("smoke", store), step, {"w": torch.zeros(2)}, {}, [], state, str(tmp_path / "stage"))
        ids[step] = lineage.log_checkpoint_model(step, uri, {"checkpoint": uri, "step": step})

    assert retain_checkpoints(cfg, 4, True, final=True) == [1, 2]

    client = MlflowClient(cfg.tracking.uri)
    models = {s: client.get_logged_model(i) for s, i in ids.items()}
    assert {s: str(m.status) for s, m in models.items()} == {1: "FAILED", 2: "FAILED", 3: "READY", 4: "READY"}
    retired = {s: m.tags.get(DELETED_TAG) for s, m in models.items() if DELETED_TAG in m.tags}
    assert retired == dict.fromkeys(
        [1, 2], "deleted by checkpoint retention (checkpoint.keep_last=2, checkpoint.keep_best=False)"
    )
    assert "deleted by checkpoint retention" in models[1].tags["mlflow.note.content"]
    # a second pass (the next checkpoint's retention) leaves the retired ones as they are
    assert lineage.retire_checkpoint_models([1, 2]) == []
