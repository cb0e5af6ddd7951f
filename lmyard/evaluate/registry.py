"""The evaluations by name, and which of them a run's `eval` section enables.

    EVALUATIONS: val_loss, hellaswag, harness, samples (lmyard.evaluate.builtins), then those installed
    packages declare under the entry-point group `lmyard.evaluations` (`name = module:SPEC`)

A new evaluation is a module holding its `EvaluationSpec` (lmyard.evaluate.spec: its run, metrics, gates)
and one line below, with its keys in the `eval` section (lmyard.config.evaluation); or, outside lmyard, that
module and one entry point. Everything else asks this module: the evaluator runs what `enabled` returns, in
order; the register task's gates (lmyard.evaluate.gates) find the metric each `eval.gates` key limits here.
Importing it loads no torch.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from lmyard.config import EvalConfig
from lmyard.errors import UserError
from lmyard.evaluate import builtins
from lmyard.evaluate.spec import EvaluationSpec

GROUP = "lmyard.evaluations"
BUILTIN: tuple[EvaluationSpec, ...] = (builtins.VAL_LOSS, builtins.HELLASWAG, builtins.HARNESS, builtins.SAMPLES)


def evaluations() -> dict[str, EvaluationSpec]:
    """Every evaluation by name: the built-in ones, then the installed packages' entry points."""
    out = {s.name: s for s in BUILTIN}
    for point in entry_points(group=GROUP):
        spec = point.load()
        if not isinstance(spec, EvaluationSpec):
            raise UserError(
                f"entry point {point.name} = {point.value} of group {GROUP} is a {type(spec).__name__}, not an "
                "lmyard.evaluate.spec.EvaluationSpec: point it at the module's SPEC"
            )
        if spec.name in out:
            raise UserError(
                f"entry point {point.value} of group {GROUP} names evaluation {spec.name!r} again: rename it"
            )
        out[spec.name] = spec
    return out


def enabled(e: EvalConfig) -> list[EvaluationSpec]:
    """The evaluations the `eval` section asks for, in the registry's order."""
    return [s for s in evaluations().values() if s.enabled(e)]


def gate_metrics() -> dict[str, str]:
    """`eval.gates` key -> the metric that gate limits."""
    return {gate: metric for s in evaluations().values() for gate, metric in s.gates.items()}
