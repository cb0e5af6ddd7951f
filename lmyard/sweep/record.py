"""The sweep's MLflow run: the parent of its trials' lineage runs (their `mlflow.parentRunId`), the table of
trials and, for a size sweep, the loss against compute with a fitted power law.

A trial is finished when its lineage's run is FINISHED (the pretrain flow closed it after its final checkpoint),
stopped when the scheduler stopped it early (the tag `lmyard.sweep.stopped_at_step`: the step of the scheduler's
decision; the lineage may hold later steps, logged before the SIGTERM landed); a resumed sweep skips both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmyard.config import RunConfig, redact_uri
from lmyard.models import registry
from lmyard.run import Run
from lmyard.tracking.client import check_reachable, mlflow_client
from lmyard.tracking.lineage import Lineage, _experiment_id

SWEEP_TAG = "lmyard.sweep"
STOPPED_TAG = "lmyard.sweep.stopped_at_step"


@dataclass(frozen=True)
class Outcome:
    """What a trial's lineage says: its last val loss and step, and whether it is done."""

    name: str
    status: str  # finished, stopped, failed, running or not started
    step: int | None
    val_loss: float | None
    run_id: str | None


def open_parent(cfg: RunConfig, kind: str) -> str:
    """The sweep's run (by its name, tagged lmyard.sweep), created or reopened RUNNING; its id."""
    check_reachable(cfg.tracking.uri)
    client = mlflow_client(cfg.tracking.uri)
    experiment_id = _experiment_id(client, cfg)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{cfg.run_name}'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    run = client.create_run(
        experiment_id, run_name=cfg.run_name, tags={SWEEP_TAG: cfg.run_name, "lmyard.sweep.kind": kind}
    )
    client.log_batch(run.info.run_id, params=_params(cfg))
    return run.info.run_id


def _params(cfg: RunConfig) -> list:
    from mlflow.entities import Param

    return [Param(k, v[:6000]) for k, v in cfg.flat().items() if k not in ("run_name", "tracking.parent_run_id")]


def close_parent(cfg: RunConfig, run_id: str, status: str) -> None:
    mlflow_client(cfg.tracking.uri).set_terminated(run_id, status)


def outcome(cfg: RunConfig, trial: Run) -> Outcome:
    """How the trial's lineage (`trial`: its handle) stands: not started, running, finished, stopped or failed."""
    lineage = Lineage.find(cfg.tracking.uri, trial)
    if lineage is None:
        return Outcome(trial.name, "not started", None, None, None)
    run = lineage.client.get_run(lineage.ref.mlflow_run_id)
    history = lineage.metric_history("loss/val")
    step = max(history) if history else None
    status = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "failed"}.get(run.info.status, "running")
    if STOPPED_TAG in run.data.tags and status != "finished":  # one that ended before its stop landed: finished
        status = "stopped"
    return Outcome(trial.name, status, step, history[step] if step is not None else None, lineage.ref.mlflow_run_id)


def done(o: Outcome) -> bool:
    return o.status in ("finished", "stopped")


def mark_stopped(cfg: RunConfig, trial: Run, step: int) -> None:
    """Tag a trial the scheduler stopped at `step` (before its last): done for the sweep, not for its lineage."""
    lineage = Lineage.find(cfg.tracking.uri, trial)
    if lineage is not None:
        lineage.set_tags({STOPPED_TAG: str(step)})


def compute(config: dict[str, Any], n_vocab: int, steps: int | None) -> tuple[int, int, float]:
    """(parameters N, tokens D, 6*N*D training FLOPs) of a trial's config (RunConfig's fields) at `steps`."""
    cfg = RunConfig.model_validate(config)
    n = registry.parameters({"arch": cfg.model.architecture(), **registry.resolve(cfg.model, n_vocab)})
    d = (steps or 0) * cfg.train.batch_tokens
    return n, d, 6.0 * n * d


def power_law(flops: list[float], losses: list[float]) -> tuple[float, float] | None:
    """(a, b) of loss = a * C^b fitted in log space (numpy's polyfit); None for fewer than two points."""
    import numpy as np

    points = [(c, loss) for c, loss in zip(flops, losses) if c > 0 and loss is not None and loss > 0]
    if len({c for c, _ in points}) < 2:
        return None
    slope, intercept = np.polyfit(np.log([c for c, _ in points]), np.log([loss for _, loss in points]), 1)
    return math.exp(float(intercept)), float(slope)


def log_summary(cfg: RunConfig, parent: str, rows: list[dict[str, Any]], kind: str) -> str:
    """The table of trials (trials.json) on the parent run; for a size sweep the power law's metrics and a plot
    (loss_vs_compute.png, when matplotlib is installed); for an isoFLOP sweep its fit (`log_isoflop`). A line
    saying what was logged (an isoFLOP sweep's: the recommended size of each budget too)."""
    client = mlflow_client(cfg.tracking.uri)
    columns = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
    client.log_table(parent, data=columns, artifact_file="trials.json")
    said = f"{len(rows)} trials logged to MLflow run {parent} ({redact_uri(cfg.tracking.uri)})"
    if kind == "isoflop":
        return said + log_isoflop(client, parent, rows, columns)
    sizes = kind == "sizes"
    fit = power_law([r["flops"] for r in rows], [r["val_loss"] for r in rows]) if sizes else None
    client.set_tag(parent, "mlflow.note.content", _description(columns, fit))  # the run page's Description
    if not sizes:
        return said
    if fit is None:
        return said + "; too few finished sizes for a power law"
    a, b = fit
    client.log_metric(parent, "sweep/power_law_exponent", b)
    client.log_metric(parent, "sweep/power_law_coefficient", a)
    return said + f"; val loss = {a:.4g} * C^{b:.4f} (C = 6ND FLOPs)" + _plot(client, parent, rows, a, b)


def _description(columns: dict[str, list], fit: tuple[float, float] | None) -> str:
    """The trials as a markdown table (and a size sweep's fit), for the parent run's page."""

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)

    columns = {k: v for k, v in columns.items() if k != "mlflow_run_id"}  # the child runs are linked already
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in zip(*columns.values(), strict=True)]
    law = [f"\nval loss = {fit[0]:.4g} * C^{fit[1]:.4f} (C = 6ND training FLOPs)"] if fit else []
    return "\n".join(["Trials of this sweep (trials.json):", "", *lines, *law])


def _plot(client, parent: str, rows: list[dict[str, Any]], a: float, b: float) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "; no plot (matplotlib is not installed)"
    points = sorted((r["flops"], r["val_loss"]) for r in rows if r["flops"] and r["val_loss"] is not None)
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.loglog([c for c, _ in points], [v for _, v in points], "o", label="trials")
    ax.loglog([c for c, _ in points], [a * c**b for c, _ in points], "-", label=f"{a:.3g} C^{b:.3f}")
    ax.set_xlabel("training FLOPs (6ND)")
    ax.set_ylabel("val loss")
    _inside(ax, [c for c, _ in points], [y for c, v in points for y in (v, a * c**b)])
    ax.legend()
    fig.tight_layout()  # the loss's tick labels inside the figure, not cut at its left edge
    client.log_figure(parent, fig, "loss_vs_compute.png")
    plt.close(fig)
    return ", plotted"


def _inside(ax, xs: list[float], ys: list[float]) -> None:
    """Log axes that hold every point and the fit with a margin, the loss's ticks labelled as plain numbers (a few
    trials span less than a decade of loss: matplotlib labels it `5.3 x 10^0`, wider than the figure's margin)."""
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
    ax.set_ylim(min(ys) / 1.15, max(ys) * 1.15)
    ax.yaxis.set_major_locator(LogLocator(subs="all"))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())


def _budget_key(budget: float) -> str:
    """A budget as an MLflow key part: 1.6e9 -> 1.6e09 (MLflow keys take no '+')."""
    return f"{budget:.3g}".replace("+", "")


def log_isoflop(client, parent: str, rows: list[dict[str, Any]], columns: dict[str, list]) -> str:
    """An isoFLOP sweep's fit (lmyard.sweep.isoflop) on the parent run: each budget's optimum
    (`sweep/optimal_params/C_<budget>`, where its parabola has one), the exponent of N* = k C^a and its R²
    (`sweep/optimal_params_exponent`, `sweep/optimal_params_r2`; none through fewer than 3 optima), the lines
    that recommend a size (the run's description too), and loss_vs_compute.png. Returns the lines, joined."""
    import tempfile

    from lmyard.sweep import isoflop

    points = [isoflop.Point(r["budget"], r["params"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    fit = isoflop.fit(points)
    sizes = {r["size"]: r["params"] for r in rows}
    lines = isoflop.describe(fit, sizes)
    metrics: dict[str, float | None] = {
        f"sweep/optimal_params/C_{_budget_key(o.budget)}": o.params for o in fit.optima if o.params
    }
    metrics |= {  # none through fewer than 3 optima (fit.note says so)
        "sweep/optimal_params_exponent": fit.exponent,
        "sweep/optimal_params_r2": fit.r2,
        "sweep/optimal_params_coefficient": fit.coefficient,
    }
    for key, value in metrics.items():
        if value is not None:
            client.log_metric(parent, key, float(value))
    table = _description(columns, None)
    client.set_tag(parent, "mlflow.note.content", table + "\n\nCompute-optimal size:\n\n" + "\n".join(lines))
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/loss_vs_compute.png"
        plotted = isoflop.plot(fit, path)
        if plotted:
            client.log_artifact(parent, path)
    return "".join(f"\n{line}" for line in lines) + ("" if plotted else "\nno plot (matplotlib is not installed)")
