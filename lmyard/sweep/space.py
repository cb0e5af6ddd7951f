"""The trials of a sweep: a family of sizes from one recipe, or a search space over any config keys.

Design notes: docs/sweeps.md, `lmyard/sweep/space.py`.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.models import registry
from lmyard.recipes import format_validation_error

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform", "randint")
SCHEDULERS = ("asha",)


@dataclass(frozen=True)
class Trial:
    """One lineage of a sweep: its run name and the `--set` values it adds to the sweep's config."""

    name: str
    overrides: dict[str, Any]
    size: int | None = None
    """The scaling index of a size sweep's trial."""
    budget: float | None = None
    """An isoFLOP sweep's compute budget for the trial (6ND FLOPs), which set its train.max_steps."""


@dataclass(frozen=True)
class Schedule:
    """Early stopping on the val loss (Ray Tune's ASHA): a trial is measured at grace_steps, then at each
    reduction_factor times as many steps; the worst are stopped."""

    grace_steps: int = 1
    reduction_factor: float = 2.0


@dataclass(frozen=True)
class Space:
    params: dict[str, dict[str, list]]
    samples: int = 1
    seed: int = 0
    schedule: Schedule | None = None
    source: str = field(default="search space", compare=False)


def size_trials(config: RunConfig, sizes: list[int]) -> list[Trial]:
    """One trial per scaling index, each a lineage `<run_name>-x<index>`; the config must hold every size."""
    if not sizes:
        raise UserError("--sizes is empty: give scaling indices, e.g. --sizes 1,2,3")
    if any(i < 1 for i in sizes) or len(set(sizes)) != len(sizes):
        raise UserError(f"--sizes {','.join(map(str, sizes))}: give distinct indices of 1 or more, e.g. --sizes 1,2,3")
    if config.model.init_from:
        raise UserError("model.init_from fixes the model's size: a size sweep trains models of its own sizes")
    return [
        Trial(f"{config.run_name}-x{i}", {f"model.{k}": v for k, v in registry.scaled(config.model, i).items()}, i)
        for i in sizes
    ]


TOKENS_PER_PARAM = 20
"""Chinchilla's compute-optimal tokens per parameter (Hoffmann et al. 2022): D* = 20 N*, so C = 6 N D = 120 N*²."""
SIZES_PER_BUDGET = 5
SPREAD = 1.7
"""The ratio in N between a budget's neighbouring target sizes: 5 span N*/2.9 .. 2.9 N*, wide enough that the loss
turns inside them (the parabola's vertex) and narrow enough that each is within a few times of the optimum."""


def chinchilla_params(budget: float, tokens_per_param: float = TOKENS_PER_PARAM) -> float:
    """The parameters N at `budget` FLOPs (6ND) that train on `tokens_per_param` tokens each: sqrt(C / 6r)
    (Chinchilla's optimum sqrt(C / 120) at its r = 20)."""
    return math.sqrt(budget / (6 * tokens_per_param))


def isoflop_trials(
    config: RunConfig,
    sizes: list[int] | None,
    budgets: list[float],
    n_vocab: int,
    tokens_per_param: float = TOKENS_PER_PARAM,
) -> list[Trial]:
    """Each budget C's sizes, `<run_name>-x<index>-c<C>`, with train.max_steps set so that 6 N x steps x
    train.batch_tokens is C (lmyard.sweep.isoflop.steps_for). The sizes: `sizes` at every budget, or (None) each
    budget's own (budget_sizes: around the N that trains on `tokens_per_param` tokens a parameter, Chinchilla's 20 by
    default, so that each budget's parabola has its vertex inside)."""
    from lmyard.sweep.isoflop import steps_for

    if not budgets or any(not (c > 0 and math.isfinite(c)) for c in budgets) or len(set(budgets)) != len(budgets):
        raise UserError("--budgets: give distinct compute budgets in FLOPs (6ND), e.g. --budgets 1e15,3e15,1e16")
    if config.model.init_from:
        raise UserError("model.init_from fixes the model's size: an isoFLOP sweep trains models of its own sizes")
    if not (tokens_per_param > 0 and math.isfinite(tokens_per_param)):
        raise UserError(f"--tokens-per-param {tokens_per_param:g}: give a positive number, e.g. 20 (Chinchilla's)")
    counts: dict[int, int] = {}
    trials = []
    for c in sorted(budgets):
        for t in size_trials(
            config, sizes if sizes is not None else budget_sizes(config, c, n_vocab, counts, tokens_per_param)
        ):
            steps = steps_for(c, _params(config, t.size or 1, n_vocab, counts), config.train.batch_tokens)
            label = f"{c:.2g}".replace("+", "")
            trials.append(Trial(f"{t.name}-c{label}", {**t.overrides, "train.max_steps": steps}, t.size, c))
    return trials


def budget_sizes(
    config: RunConfig,
    budget: float,
    n_vocab: int,
    counts: dict[int, int] | None = None,
    tokens_per_param: float = TOKENS_PER_PARAM,
) -> list[int]:
    """The scaling indices of one budget: for each of SIZES_PER_BUDGET targets N* x SPREAD^k (k centred on 0, N*
    sqrt(C/6r) at r = `tokens_per_param`: Chinchilla's sqrt(C/120) by default) the index whose parameter count is
    nearest in ln N, without repeats. UserError when they do not bracket N* with 3 or more sizes (the budget is too
    small for the model's narrowest sizes)."""
    from lmyard.sweep.isoflop import MIN_POINTS

    counts = {} if counts is None else counts
    optimum = chinchilla_params(budget, tokens_per_param)
    half = (SIZES_PER_BUDGET - 1) / 2
    chosen = sorted(
        {_nearest(config, optimum * SPREAD ** (k - half), n_vocab, counts) for k in range(SIZES_PER_BUDGET)}
    )
    lowest, highest = (_params(config, i, n_vocab, counts) for i in (chosen[0], chosen[-1]))
    if len(chosen) < MIN_POINTS or not lowest < optimum < highest:
        least = 6 * tokens_per_param * _params(config, 2, n_vocab, counts) ** 2
        raise UserError(
            f"--budgets {budget:.3g}: the size its sizes centre on, sqrt(C/{6 * tokens_per_param:g}) = {optimum:.3g} "
            f"parameters, is too near the narrowest size (x1: {_params(config, 1, n_vocab, counts):.3g}) to be bracketed; give budgets "
            f"of at least {least:.2g} FLOPs, a narrower model.n_embd, or --sizes"
        )
    return chosen


def _nearest(config: RunConfig, target: float, n_vocab: int, counts: dict[int, int]) -> int:
    """The scaling index whose parameter count is nearest `target` in ln N (counts grow with the index)."""
    hi = 1
    while _params(config, hi, n_vocab, counts) < target:
        hi *= 2
    lo = max(1, hi // 2)
    while lo < hi:  # the first index at or above target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if _params(config, mid, n_vocab, counts) < target else (lo, mid)
    below = max(1, hi - 1)
    return min((below, hi), key=lambda i: abs(math.log(_params(config, i, n_vocab, counts) / target)))


def _params(config: RunConfig, index: int, n_vocab: int, counts: dict[int, int]) -> int:
    """Parameters of size `index` of the config's model (memoized in `counts`)."""
    if index not in counts:
        scaled = registry.scaled(config.model, index)
        fields = registry.resolve(config.model.model_copy(update=scaled), n_vocab)
        counts[index] = registry.parameters({"arch": config.model.architecture(), **fields})
    return counts[index]


def _known_key(key: str) -> bool:
    node: type[BaseModel] | None = RunConfig
    for part in key.split("."):
        if node is None or part not in node.model_fields:
            return False
        annotation = node.model_fields[part].annotation
        node = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return node is None


def _distribution(source: str, key: str, spec: Any) -> dict[str, list]:
    where = f"{source}: params.{key}"
    if not _known_key(key):
        raise UserError(f"{where}: no such config key; see `lmyard config` for the keys of a run")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise UserError(f"{where}: give one distribution, one of {', '.join(DISTRIBUTIONS)}, e.g. {{grid: [1, 2]}}")
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list) or not values:
        raise UserError(f"{where}: {kind} needs a non-empty list, e.g. {{{kind}: [1, 2]}}")
    if kind in ("uniform", "loguniform", "randint"):
        if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise UserError(f"{where}: {kind} takes [low, high], two numbers")
        lo, hi = values
        if not lo < hi or (kind == "loguniform" and lo <= 0):
            raise UserError(f"{where}: {kind} needs low < high" + (" and low > 0" if kind == "loguniform" else ""))
    return {kind: values}


def _schedule(source: str, raw: Any) -> Schedule | None:
    if raw in (None, "none"):
        return None
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in SCHEDULERS:
        raise UserError(f"{source}: scheduler: give {{asha: {{grace_steps: N, reduction_factor: F}}}} or none")
    opts = next(iter(raw.values())) or {}
    unknown = set(opts) - {"grace_steps", "reduction_factor"}
    if unknown:
        raise UserError(f"{source}: scheduler.asha: unknown {sorted(unknown)}; use grace_steps, reduction_factor")
    schedule = Schedule(**opts)
    if schedule.grace_steps < 1 or schedule.reduction_factor <= 1:
        raise UserError(f"{source}: scheduler.asha: grace_steps must be 1 or more and reduction_factor more than 1")
    return schedule


def parse_space(raw: Any, source: str = "search space") -> Space:
    """A search space from its mapping (a file's YAML, or a deployment's parameter); UserError naming the key."""
    if not isinstance(raw, dict) or not isinstance(raw.get("params"), dict) or not raw["params"]:
        raise UserError(f"{source}: expected a mapping with `params:` naming at least one config key")
    unknown = set(raw) - {"params", "samples", "seed", "scheduler"}
    if unknown:
        raise UserError(f"{source}: unknown {sorted(unknown)}; a space has params, samples, seed, scheduler")
    samples, seed = raw.get("samples", 1), raw.get("seed", 0)
    if not isinstance(samples, int) or samples < 1 or not isinstance(seed, int):
        raise UserError(f"{source}: samples must be a whole number of 1 or more, seed a whole number")
    params = {str(k): _distribution(source, str(k), v) for k, v in raw["params"].items()}
    return Space(params, samples, seed, _schedule(source, raw.get("scheduler")), source)


def read_space(path: str | Path) -> Space:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise UserError(f"--search {p}: no such file; give a YAML search space (docs/sweeps.md)") from None
    except yaml.YAMLError as e:
        raise UserError(f"--search {p}: not valid YAML: {str(e).splitlines()[0]}") from None
    return parse_space(raw, f"--search {p}")


def _draw(kind: str, values: list, rng: random.Random) -> Any:
    if kind == "choice":
        return rng.choice(values)
    lo, hi = values
    if kind == "uniform":
        return rng.uniform(lo, hi)
    if kind == "loguniform":
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return rng.randrange(int(lo), int(hi))


def search_trials(config: RunConfig, space: Space) -> list[Trial]:
    """Every grid point times `samples` draws of the other keys, `<run_name>-t<NN>` in order: the same space and
    seed make the same trials (a resumed sweep finds its lineages)."""
    grid = {k: d["grid"] for k, d in space.params.items() if "grid" in d}
    drawn = {k: next(iter(d.items())) for k, d in space.params.items() if "grid" not in d}
    rng = random.Random(space.seed)
    trials: list[Trial] = []
    for point in itertools.product(*grid.values()):
        for _ in range(space.samples if drawn else 1):
            overrides = {**dict(zip(grid, point)), **{k: _draw(kind, v, rng) for k, (kind, v) in drawn.items()}}
            trials.append(Trial(f"{config.run_name}-t{len(trials):02d}", overrides))
    return trials


def trial_config(config: RunConfig, trial: Trial, parent_run_id: str | None = None) -> dict[str, Any]:
    """The fields a trial sets explicitly (the sweep's, its overrides, its run name and parent run), validated as a
    whole config: a value that cannot work is one UserError naming the trial, before anything trains."""
    data = config.model_dump(mode="json", exclude_unset=True)
    # trials compare losses: no export, no registered version each, unless the sweep sets tracking.registry itself
    # (the best trial is registered on request: docs/sweeps.md)
    data.setdefault("tracking", {}).setdefault("registry", False)
    # a relative store or sqlite file is this folder's: the trial's process may start in another
    data["store"], data.setdefault("tracking", {})["uri"] = (
        absolute_uri(config.store),
        absolute_uri(config.tracking.uri),
    )
    for key, value in {**trial.overrides, "run_name": trial.name, "tracking.parent_run_id": parent_run_id}.items():
        node = data
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[key.split(".")[-1]] = value
    try:
        RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(f"trial {trial.name} ({said(trial.overrides)}): {format_validation_error(e)}") from None
    return data


def absolute_uri(uri: str) -> str:
    """A local store path or sqlite file as an absolute one (other URIs as they are)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri.removeprefix("sqlite:///"))
    return uri if "://" in uri else os.path.abspath(uri)


def said(overrides: dict[str, Any]) -> str:
    """A trial's overrides as `key=value, ...` (floats to 4 digits): how a message names them."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in overrides.items())


def assignments(data: dict[str, Any], prefix: str = "") -> list[str]:
    """`dotted.key=value` for every leaf of a trial's fields (values as JSON, which `--set` reads back as YAML)."""
    import json

    out = []
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out += assignments(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={json.dumps(v)}")
    return out
