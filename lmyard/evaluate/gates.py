"""The eval gates of registration: does the final evaluation pass `eval.gates`?

Torch-free: the register task (flow process) decides the registry alias with
it. Every gate is a bound on a logged metric (`eval.gates.metrics`; the named
gates `val_loss_max` and `hellaswag_acc_norm_min` are gates on `eval/val_loss`
and `eval/hellaswag_acc_norm`). The value is the final evaluation's, else the
lineage's latest logged value. A gate whose metric was not measured fails, so
a missing HellaSwag file cannot promote a model.
"""

from __future__ import annotations

from typing import Any

from lmyard.config import EvalGates


def result_metrics(result: dict[str, Any]) -> dict[str, float]:
    """An evaluation's result (lmyard.contracts.EvalResult, as a dict) under the names it is logged with."""
    out: dict[str, float] = {}
    if result.get("val_loss") is not None:
        out["eval/val_loss"] = result["val_loss"]
    hs = result.get("hellaswag") or {}
    for key in ("acc", "acc_norm"):
        if hs.get(key) is not None:
            out[f"eval/hellaswag_{key}"] = hs[key]
    out.update({f"harness/{k}": v for k, v in ((result.get("harness") or {}).get("metrics") or {}).items()})
    return out


def gate_results(
    gates: EvalGates, result: dict[str, Any], logged: dict[str, float] | None = None
) -> dict[str, dict[str, Any]]:
    """Each configured gate: {value, limit, passed}; a gate whose metric was not measured fails. The named gates
    keep their names (`val_loss_max`); the others are `METRIC max` or `METRIC min`. `logged`: the run's latest
    value of each metric, for metrics the final evaluation does not measure."""
    measured = {**(logged or {}), **result_metrics(result)}
    names = {"eval/val_loss max": "val_loss_max", "eval/hellaswag_acc_norm min": "hellaswag_acc_norm_min"}
    out = {}
    for i, gate in enumerate(gates.all()):
        value = measured.get(gate.metric)
        limit = gate.max if gate.max is not None else gate.min
        assert limit is not None  # MetricGate holds exactly one bound
        passed = value is not None and (value <= limit if gate.max is not None else value >= limit)
        name = names.get(gate.name, gate.name) if i < len(gates.configured()) else gate.name
        out[name] = {"value": value, "limit": limit, "passed": passed}
    return out
