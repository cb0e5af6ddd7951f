"""MLflow tracking on a sqlite store (no server): one metric value per step across attempts; evaluations
linked to logged models."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from lmyard.tracking.sink import MLflowSink


def test_resumed_sink_does_not_log_a_step_twice(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("sink", artifact_location=str(tmp_path / "a"))).info.run_id

    first = MLflowSink(uri, run_id)  # an attempt that reached step 5, then died
    for step in range(1, 6):
        first.log({"train/loss": 10.0 - step}, step)
    first.close()
    second = MLflowSink(uri, run_id)  # resumed from a checkpoint at step 3: repeats 4 and 5, with other timings
    for step in range(4, 9):
        second.log({"train/loss": 100.0 + step, "step_time_s": 0.1}, step)
    second.flush()
    second.log({"train/loss": 0.5}, 8)  # the same step again within one sink is dropped too
    second.close()

    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(history) == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    # a key the earlier attempt never logged starts where this attempt starts
    assert sorted(m.step for m in client.get_metric_history(run_id, "step_time_s")) == [4, 5, 6, 7, 8]
    assert second.skipped == 3


def test_evaluation_is_logged_at_its_step_and_linked_to_the_checkpoints_logged_model(tmp_path):
    from lmyard.config import load_recipe
    from lmyard.store import open_store
    from lmyard.tracking.lineage import Lineage
    from tasks.evaluate import _log_to_mlflow

    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    lineage = Lineage.open(cfg, open_store(cfg.store), shard_address="a" * 64, code_version="test")
    ckpt = f"{cfg.store}/runs/smoke/checkpoints/step_00000003"
    _log_to_mlflow(
        lineage,
        {
            "step": 3,
            "checkpoint": ckpt,
            "tokens_seen": 12288,
            "val_loss": 2.5,
            "trainer_val_loss": 2.5,
            "eval_s": 1.0,
            "samples": [{"prompt": "A class is", "completion": " a"}],
            "harness": {"metrics": {"hellaswag_local/acc": 0.5, "hellaswag_local/acc_norm": 0.75}},
        },
    )

    client = MlflowClient(cfg.tracking.uri)
    history = client.get_metric_history(lineage.mlflow_run_id, "harness/hellaswag_local/acc_norm")
    assert [(m.step, m.value) for m in history] == [(3, 0.75)]
    [model] = client.search_logged_models([lineage.experiment_id])
    assert model.name == "smoke-step-00000003" and model.params == {"checkpoint_uri": ckpt, "step": "3"}
    assert {m.key: (m.step, m.value) for m in model.metrics} == {
        "eval/val_loss": (3, 2.5),
        "eval/seconds": (3, 1.0),
        "harness/hellaswag_local/acc": (3, 0.5),
        "harness/hellaswag_local/acc_norm": (3, 0.75),
    }
    assert [o.model_id for o in client.get_run(lineage.mlflow_run_id).outputs.model_outputs] == [model.model_id]
