"""GPU-hours and node-hours: every attempt's nodes, GPUs per node and wall-clock, summed per lineage.

Each attempt of a lineage records on its MLflow run (tags `lmyard.attempt.<n>.*`, lmyard.tracking.lineage):
`nodes`, `gpus_per_node` (the ranks per node on CUDA, 0 on a CPU), `started_at` (epoch seconds), the
`gpu_hour_price` when tracking.gpu_hour_price is set, and as it ends `wall_s`, `node_hours` and `gpu_hours`.
The lineage's totals are metrics of the run, logged as each attempt ends with the attempt's number as their
step: `system/cost/node_hours`, `system/cost/gpu_hours` and, with a price, `system/cost/estimate` (the attempts' GPU-hours at the
price each recorded). `lmyard status` shows them, `lmyard runs --cost` totals them by experiment.

An attempt whose process died with it (a killed worker) records no end: its hours are not counted.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

NODE_HOURS = "system/cost/node_hours"  # on the System metrics tab: the losses lead the Model metrics tab
GPU_HOURS, ESTIMATE = "system/cost/gpu_hours", "system/cost/estimate"


class Usage(BaseModel):
    """What a lineage (or an experiment's lineages) used: hours of nodes and of GPUs, and their price."""

    wall_s: float = 0.0
    node_hours: float = 0.0
    gpu_hours: float = 0.0
    estimate: float | None = None  # at the recorded gpu_hour_price; None when no attempt recorded one

    def __add__(self, other: Usage) -> Usage:
        prices = [u.estimate for u in (self, other) if u.estimate is not None]
        return Usage(
            wall_s=self.wall_s + other.wall_s,
            node_hours=self.node_hours + other.node_hours,
            gpu_hours=self.gpu_hours + other.gpu_hours,
            estimate=sum(prices) if prices else None,
        )

    def metrics(self) -> dict[str, float]:
        out = {NODE_HOURS: self.node_hours, GPU_HOURS: self.gpu_hours}
        return out | ({ESTIMATE: self.estimate} if self.estimate is not None else {})

    def words(self) -> str:
        text = f"{self.gpu_hours:.4g} GPU-hours, {self.node_hours:.4g} node-hours ({self.wall_s:,.0f} s of wall-clock)"
        return text + (f", cost estimate {self.estimate:,.2f}" if self.estimate is not None else "")


def _number(attempt: dict, key: str) -> float | None:
    try:
        return float(attempt[key])
    except (KeyError, TypeError, ValueError):
        return None


def ended(attempt: dict, now: float | None = None) -> dict[str, str]:
    """The tags that close an attempt's usage (`attempt`: its recorded fields, lmyard.tracking.lineage's
    `attempts()` shape): wall_s since started_at, node_hours, gpu_hours; {} when it recorded no start."""
    started = _number(attempt, "started_at")
    if started is None:
        return {}
    wall = max(0.0, (now or time.time()) - started)
    nodes, gpus = _number(attempt, "nodes") or 0.0, _number(attempt, "gpus_per_node") or 0.0
    node_hours = nodes * wall / 3600
    return {"wall_s": f"{wall:.3f}", "node_hours": f"{node_hours:.6f}", "gpu_hours": f"{node_hours * gpus:.6f}"}


def of_attempt(attempt: dict) -> Usage:
    """One ended attempt's usage (zero for one that recorded no end)."""
    gpu_hours = _number(attempt, "gpu_hours") or 0.0
    price = _number(attempt, "gpu_hour_price")
    return Usage(
        wall_s=_number(attempt, "wall_s") or 0.0,
        node_hours=_number(attempt, "node_hours") or 0.0,
        gpu_hours=gpu_hours,
        estimate=gpu_hours * price if price is not None else None,
    )


def of_lineage(attempts: list[dict]) -> Usage:
    """The sum over a lineage's attempts."""
    return sum((of_attempt(a) for a in attempts), Usage())
