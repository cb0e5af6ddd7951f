"""The eval gates of registration: does the final evaluation pass `eval.gates`?

Torch-free: the register task (flow process) decides the registry alias with
it. A gate whose metric was not measured fails, so a missing HellaSwag file
cannot promote a model.
"""

from __future__ import annotations

from typing import Any

from lmyard.config import EvalGates


def gate_results(gates: EvalGates, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each configured gate: {value, limit, passed}; a gate whose metric was not measured fails."""
    hs = result.get("hellaswag") or {}
    measured = {"val_loss_max": result.get("val_loss"), "hellaswag_acc_norm_min": hs.get("acc_norm")}
    out = {}
    for name, limit in gates.configured().items():
        value = measured[name]
        passed = value is not None and (value <= limit if name.endswith("_max") else value >= limit)
        out[name] = {"value": value, "limit": limit, "passed": passed}
    return out
