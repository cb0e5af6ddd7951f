"""The eval gates of registration: does the final evaluation pass `eval.gates`?

Torch-free: the register task (flow process) decides the registry alias with
it. Each gate limits a metric that an evaluation's spec names
(lmyard.evaluate.registry.gate_metrics); a gate whose metric was not measured
fails, so a missing HellaSwag file cannot promote a model.
"""

from __future__ import annotations

from typing import Any

from lmyard.config import EvalGates
from lmyard.evaluate import registry


def gate_results(gates: EvalGates, metrics: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each configured gate: {value, limit, passed}, from the final evaluation's metrics (EvalResult.metrics);
    a gate whose metric was not measured fails."""
    limited = registry.gate_metrics()
    out = {}
    for name, limit in gates.configured().items():
        value = metrics.get(limited[name])
        passed = value is not None and (value <= limit if name.endswith("_max") else value >= limit)
        out[name] = {"value": value, "limit": limit, "passed": passed}
    return out
