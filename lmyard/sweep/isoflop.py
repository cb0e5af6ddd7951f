"""The compute-optimal model size from an isoFLOP sweep (Chinchilla's approach 2, Hoffmann et al. 2022).

`steps_for` gives each size its tokens at a budget (6ND = C); `fit_budget` fits loss against ln N by a parabola
(its vertex: the budget's optimum); `fit` fits N* = k C^a over the budgets with its R² (none through fewer than 3
optima, and the note says so); `recommend` and `describe` give each budget's size; `plot` draws
loss_vs_compute.png. numpy only (matplotlib for the plot): `lmyard sweep --budgets` and
tests/benchmarks/bench_isoflop.py fit with this same code. Design: docs/sweeps.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_POINTS = 3  # a parabola per budget, and the power law over budgets, each need at least this many points


@dataclass(frozen=True)
class Point:
    budget: float  # the budget C the trial was given (FLOPs, 6ND)
    params: float  # N
    loss: float  # its last val loss


@dataclass(frozen=True)
class Optimum:
    budget: float
    params: float | None  # N*(C): the parabola's vertex; None where there is none (see note)
    loss: float | None  # the parabola's value there
    parabola: tuple[float, float, float] | None  # loss = a x^2 + b x + c, x = ln N
    note: str = ""


@dataclass(frozen=True)
class Fit:
    optima: list[Optimum]
    exponent: float | None = None  # a of N* = k C^a
    coefficient: float | None = None  # k
    r2: float | None = None
    note: str = ""
    points: list[Point] = field(default_factory=list)


def steps_for(budget: float, params: int, batch_tokens: int) -> int:
    """Optimizer steps that spend `budget` = 6 N D FLOPs on a model of `params`, at least 1."""
    return max(1, round(budget / (6.0 * params * batch_tokens)))


def fit_budget(budget: float, points: list[Point]) -> Optimum:
    """One budget's optimum: the vertex of the parabola of loss against ln N through its points."""
    import numpy as np

    pts = sorted((p.params, p.loss) for p in points if p.params > 0 and p.loss is not None and math.isfinite(p.loss))
    if len({n for n, _ in pts}) < MIN_POINTS:
        return Optimum(budget, None, None, None, f"{len(pts)} sizes at C={budget:.3g}; a parabola needs {MIN_POINTS}")
    x = np.log([n for n, _ in pts])
    a, b, c = (float(v) for v in np.polyfit(x, [loss for _, loss in pts], 2))
    if a <= 0:
        return Optimum(budget, None, None, (a, b, c), f"at C={budget:.3g} the loss does not turn within the sizes")
    vertex = -b / (2 * a)
    if not x.min() <= vertex <= x.max():
        way = "larger" if vertex > x.max() else "smaller"
        return Optimum(
            budget, None, None, (a, b, c), f"at C={budget:.3g} the optimum lies beyond the sizes: train {way}"
        )
    return Optimum(budget, math.exp(vertex), a * vertex**2 + b * vertex + c, (a, b, c))


def fit(points: list[Point]) -> Fit:
    """Every budget's optimum, then N* = k C^a over those that have one (no exponent with fewer than 3)."""
    import numpy as np

    budgets = sorted({p.budget for p in points})
    optima = [fit_budget(c, [p for p in points if p.budget == c]) for c in budgets]
    found = [(o.budget, o.params) for o in optima if o.params is not None]
    notes = [o.note for o in optima if o.note]
    if len(found) < MIN_POINTS:
        notes.append(f"{len(found)} budgets with an optimum: a power law needs {MIN_POINTS}, no exponent fitted")
        return Fit(optima, note="; ".join(notes), points=points)
    lc, ln = np.log([c for c, _ in found]), np.log([n for _, n in found])
    slope, intercept = (float(v) for v in np.polyfit(lc, ln, 1))
    residual = ln - (slope * lc + intercept)
    spread = float(((ln - ln.mean()) ** 2).sum())
    r2 = 1.0 - float((residual**2).sum()) / spread if spread > 0 else 1.0
    return Fit(optima, slope, math.exp(intercept), r2, "; ".join(notes), points)


def recommend(f: Fit, budget: float) -> tuple[float, str] | None:
    """The compute-optimal N at `budget` and how it was found: that budget's own optimum (its parabola's vertex),
    else the power law's, else the trained size of the lowest loss at that budget; None without any."""
    own = next((o.params for o in f.optima if o.budget == budget and o.params is not None), None)
    if own is not None:
        return own, "its parabola's vertex"
    if f.exponent is not None and f.coefficient is not None:
        return f.coefficient * budget**f.exponent, "the power law"
    trained = [p for p in f.points if p.budget == budget and p.loss is not None and math.isfinite(p.loss)]
    if not trained:
        return None
    return min(trained, key=lambda p: p.loss).params, "the lowest loss trained, the optimum not bracketed"


def nearest(sizes: dict[int, float], params: float) -> int:
    """The scaling index whose parameter count is nearest `params` in log."""
    return min(sizes, key=lambda i: abs(math.log(sizes[i]) - math.log(params)))


def describe(f: Fit, sizes: dict[int, float] | None = None) -> list[str]:
    """Lines for a person: each budget's recommended size, then the power law (or why there is none)."""
    lines = []
    for o in f.optima:
        found = recommend(f, o.budget)
        if found is None:
            lines.append(f"C={o.budget:.3g} FLOPs: no recommended size ({o.note})")
            continue
        n, how = found
        near = f", nearest trained size x{nearest(sizes, n)}" if sizes else ""
        lines.append(f"C={o.budget:.3g} FLOPs: recommended size {n / 1e6:.3g}M parameters ({how}{near})")
    if f.exponent is not None:
        lines.append(f"compute-optimal size N* = {f.coefficient:.3g} * C^{f.exponent:.3f} (R² {f.r2:.3f})")
    else:
        lines.append(f"no power law: {f.note}")
    return lines


def plot(f: Fit, path: str) -> bool:
    """loss_vs_compute.png at `path`: loss against N per budget with its parabola and optimum (a star), and N*
    against C with the power law; every point inside the axes. False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = plt.get_cmap("viridis")
    ys: list[float] = []
    for i, o in enumerate(f.optima):
        color = colors(i / max(1, len(f.optima) - 1))
        pts = sorted((p.params, p.loss) for p in f.points if p.budget == o.budget)
        left.plot([n for n, _ in pts], [v for _, v in pts], "o", color=color, label=f"C={o.budget:.2g}")
        ys += [v for _, v in pts]
        if o.parabola is not None and pts:
            x = np.linspace(math.log(pts[0][0]), math.log(pts[-1][0]), 50)
            a, b, c = o.parabola
            left.plot(np.exp(x), a * x**2 + b * x + c, "-", color=color)
        if o.params is not None and o.loss is not None:
            left.plot([o.params], [o.loss], "*", color=color, markersize=14, markeredgecolor="black")
            ys.append(o.loss)
    left.set_xscale("log")
    _limits(left, [p.params for p in f.points], ys)
    left.set(xlabel="parameters N", ylabel="val loss", title="isoFLOP curves (star: optimum)")
    left.legend(fontsize=8)
    found = [(o.budget, o.params) for o in f.optima if o.params is not None]
    if found:
        right.loglog([c for c, _ in found], [n for _, n in found], "*", markersize=12, color="black", label="N*(C)")
    if f.exponent is not None and f.coefficient is not None:
        cs = np.geomspace(min(c for c, _ in found), max(c for c, _ in found), 20)
        right.loglog(
            cs, f.coefficient * cs**f.exponent, "-", label=f"{f.coefficient:.3g} C^{f.exponent:.3f}, R² {f.r2:.3f}"
        )
    if found:
        _limits(right, [c for c, _ in found], [n for _, n in found], log_y=True)
        right.legend(fontsize=8)
    else:  # an empty panel would read as a drawing that failed
        right.text(
            0.5, 0.5, "no budget's optimum inside its sizes", ha="center", va="center", transform=right.transAxes
        )
    right.set(xlabel="training FLOPs C (6ND)", ylabel="compute-optimal N*", title="optimal size against compute")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _limits(ax, xs: list[float], ys: list[float], log_y: bool = False) -> None:
    """Axes that hold every point with a margin (log x; y linear unless log_y)."""
    if not xs or not ys:
        return
    lo, hi = min(xs), max(xs)
    ax.set_xlim(lo / 1.5, hi * 1.5)
    ylo, yhi = min(ys), max(ys)
    if log_y:
        ax.set_ylim(ylo / 1.5, yhi * 1.5)
    else:
        pad = max(1e-3, 0.1 * (yhi - ylo))
        ax.set_ylim(ylo - pad, yhi + pad)
