"""GPU-hours and node-hours (lmyard.tracking.cost) of one attempt: one that never ended counts nothing, one on a
CPU node-hours only (a lineage's sums in MLflow, `lmyard status` and by experiment:
tests/integration/test_cost_integration.py)."""

from __future__ import annotations

from lmyard.tracking import cost


def test_an_attempt_that_never_ended_counts_nothing_and_one_on_a_cpu_counts_node_hours_only():
    assert cost.of_attempt({"nodes": "2", "started_at": "1000"}) == cost.Usage()
    closed = cost.ended({"nodes": "2", "gpus_per_node": "0", "started_at": "1000"}, now=1000 + 1800)
    assert closed["wall_s"] == "1800.000" and float(closed["node_hours"]) == 1.0 and float(closed["gpu_hours"]) == 0
    assert cost.of_attempt(closed).estimate is None  # no price recorded: no estimate
