"""The eval gates of registration: does the final evaluation pass `eval.gates`?

Torch-free: the register task (flow process) decides the registry alias with
it. Every gate is a bound on a logged metric: the named gates (`val_loss_max`,
`hellaswag_acc_norm_min`) on the metric their evaluation's spec names
(lmyard.evaluate.registry.gate_metrics), the others from `eval.gates.metrics`.
The value is the final evaluation's (EvalResult.metrics), else the lineage's
latest logged value. A gate whose metric was not measured fails, so a missing
HellaSwag file cannot promote a model.
"""

from __future__ import annotations

from typing import Any

from lmyard.config import EvalGates
from lmyard.evaluate import registry


def _bounds(gates: EvalGates) -> list[tuple[str, str, str, float]]:
    """(gate name, metric, "max" or "min", limit) of every configured gate: the named ones first."""
    limited = registry.gate_metrics()
    out = [(k, limited[k], "max" if k.endswith("_max") else "min", v) for k, v in gates.configured().items()]
    for g in gates.metrics:
        kind, limit = ("max", g.max) if g.max is not None else ("min", g.min)
        assert limit is not None  # MetricGate holds exactly one bound
        out.append((f"{g.metric} {kind}", g.metric, kind, limit))
    return out


def gate_results(
    gates: EvalGates, metrics: dict[str, float], logged: dict[str, float] | None = None
) -> dict[str, dict[str, Any]]:
    """Each configured gate: {value, limit, passed}; a gate whose metric was not measured fails. `metrics`: the
    final evaluation's (EvalResult.metrics); `logged`: the run's latest value of each metric, for the metrics
    the final evaluation does not measure."""
    measured = {**(logged or {}), **metrics}
    out = {}
    for name, metric, kind, limit in _bounds(gates):
        value = measured.get(metric)
        passed = value is not None and (value <= limit if kind == "max" else value >= limit)
        out[name] = {"value": value, "limit": limit, "passed": passed}
    return out
