"""The metrics sink keeps one value per step across attempts (sqlite MLflow store, no server)."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from lmyard.tracking import MLflowSink


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
