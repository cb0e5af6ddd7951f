"""GPU-hours and node-hours (lmyard.tracking.cost): every attempt's nodes, GPUs per node and wall-clock on the
lineage's MLflow run (a real sqlite store), their sums as metrics, in `lmyard status` and by experiment."""

from __future__ import annotations

import time

import pytest
from conftest import tiny_overrides
from mlflow.tracking import MlflowClient

from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking import cost
from lmyard.tracking.lineage import Lineage
from lmyard.tracking.runs import list_runs, run_status, usage_by_experiment


@pytest.mark.integration
def test_a_lineages_hours_are_the_sum_of_its_attempts_in_mlflow_in_status_and_by_experiment(tmp_path):
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **{"run_name": "costed", "tracking.experiment": "costs"}))
    store = open_store(cfg.store)
    lineage = Lineage.open(cfg, Run(cfg.run_name, store), shard_address="a" * 64, code_version="test")
    for outcome in ("failed", "finished"):  # a crashed attempt costs as much as a finished one
        lineage = lineage.record_attempt(
            resumed_from=None, start_step=0, info={"nodes": 2, "gpus_per_node": 4, "gpu_hour_price": 2.5}
        )
        time.sleep(0.5)
        lineage.end_attempt(outcome)

    status = run_status(Run("costed", store), cfg.tracking.uri)
    walls = [a.wall_s for a in status.attempts]
    assert all(w is not None and w >= 0.5 for w in walls), status.attempts
    assert [(a.nodes, a.gpus_per_node) for a in status.attempts] == [(2, 4), (2, 4)]
    usage = status.usage
    assert usage is not None
    assert abs(usage.node_hours * 3600 - sum(2 * w for w in walls)) < 1.0  # within a second
    assert abs(usage.gpu_hours * 3600 - sum(8 * w for w in walls)) < 1.0
    assert abs(usage.estimate - 2.5 * usage.gpu_hours) < 1e-6
    metrics = MlflowClient(cfg.tracking.uri).get_run(lineage.ref.mlflow_run_id).data.metrics
    assert (
        abs(metrics[cost.GPU_HOURS] - usage.gpu_hours) < 1e-5
        and abs(metrics[cost.NODE_HOURS] - usage.node_hours) < 1e-5
    )
    assert abs(metrics[cost.ESTIMATE] - usage.estimate) < 1e-4

    ((lineages, total),) = usage_by_experiment(store, list_runs(store), cfg.tracking.uri).values()
    assert lineages == 1 and abs(total.gpu_hours - usage.gpu_hours) < 1e-9
