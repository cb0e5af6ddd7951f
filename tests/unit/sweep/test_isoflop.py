"""The isoFLOP fit (lmyard.sweep.isoflop): each budget's optimum, the power law of the optimal size, what it says
when it cannot fit, and the trials an isoFLOP sweep plans."""

from __future__ import annotations

import math

import pytest
from conftest import tiny_overrides

from lmyard.errors import UserError
from lmyard.models import registry
from lmyard.recipes import load_recipe
from lmyard.sweep import isoflop
from lmyard.sweep.driver import plan

ALPHA, BETA = 0.34, 0.28  # Chinchilla's fitted exponents: the optimal N grows as C^(beta / (alpha + beta))


def _chinchilla(budgets: list[float], sizes: list[float]) -> list[isoflop.Point]:
    """Losses of L(N, D) = E + A / N^alpha + B / D^beta at D = C / 6N (Hoffmann et al. 2022's fit)."""
    return [
        isoflop.Point(c, n, 1.69 + 406.4 / n**ALPHA + 410.7 / (c / (6 * n)) ** BETA) for c in budgets for n in sizes
    ]


def test_the_fit_recovers_the_optimal_size_exponent_of_a_known_loss_surface():
    budgets = [1e17, 1e18, 1e19, 1e20]
    sizes = [10 ** (6 + k / 4) for k in range(17)]  # 1M .. 10B, bracketing every budget's optimum
    fit = isoflop.fit(_chinchilla(budgets, sizes))
    assert all(o.params is not None for o in fit.optima), [o.note for o in fit.optima]
    assert fit.exponent == pytest.approx(BETA / (ALPHA + BETA), abs=0.03)
    assert fit.r2 is not None and fit.r2 > 0.99
    for o in fit.optima:  # each vertex lies where the loss is lowest among the sizes trained, within a step
        best = min((p for p in fit.points if p.budget == o.budget), key=lambda p: p.loss)
        assert abs(math.log10(o.params) - math.log10(best.params)) <= 0.25
    recommended, how = isoflop.recommend(fit, 1e18)
    assert recommended == next(o.params for o in fit.optima if o.budget == 1e18) and "vertex" in how
    assert isoflop.recommend(fit, 1e21)[1] == "the power law"  # beyond the budgets: extrapolated


def test_fewer_than_three_budgets_say_so_and_fit_no_exponent_but_still_recommend():
    sizes = [10 ** (6 + k / 4) for k in range(17)]
    fit = isoflop.fit(_chinchilla([1e18, 1e19], sizes))
    assert fit.exponent is None and fit.r2 is None
    assert "2 budgets with an optimum: a power law needs 3, no exponent fitted" in fit.note
    lines = isoflop.describe(fit, dict(enumerate(sizes)))
    assert lines[0].startswith("C=1e+18 FLOPs: recommended size") and lines[-1].startswith("no power law")


def test_a_budget_whose_sizes_do_not_bracket_the_optimum_names_the_way_to_go():
    small = [1e5, 2e5, 4e5]  # far below 1e19's optimum: the loss falls all the way
    fit = isoflop.fit(_chinchilla([1e19], small))
    assert fit.optima[0].params is None and "train larger" in fit.optima[0].note
    n, how = isoflop.recommend(fit, 1e19)
    assert n == 4e5 and "not bracketed" in how  # the best size trained, said to be so
    two = isoflop.fit(_chinchilla([1e19], small[:2]))
    assert "2 sizes at C=1e+19; a parabola needs 3" in two.optima[0].note


def test_the_plot_is_written_with_the_fit(tmp_path):
    pytest.importorskip("matplotlib")
    sizes = [10 ** (6 + k / 4) for k in range(17)]
    path = tmp_path / "loss_vs_compute.png"
    assert isoflop.plot(isoflop.fit(_chinchilla([1e17, 1e18, 1e19], sizes)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_isoflop_plan_gives_each_size_the_steps_of_its_budget(tmp_path):
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **{"model.n_embd": 32, "model.n_head": 2}))
    p = plan(cfg, [1, 2, 3], None, budgets=[3e10, 1e10])
    assert p.kind == "isoflop" and len(p.trials) == 6
    assert [t["budget"] for t in p.trials] == [1e10] * 3 + [3e10] * 3  # in budget order
    assert p.trials[0]["name"] == "smoke-x1-c1e10"
    for budget in (1e10, 3e10):
        steps = [t["overrides"]["train.max_steps"] for t in p.trials if t["budget"] == budget]
        assert steps[0] > steps[1] > steps[2]  # the smaller the model, the more tokens for the same compute
    with pytest.raises(UserError, match="--search goes alone"):
        plan(cfg, None, {"params": {"train.lr": {"grid": [0.1]}}}, budgets=[1e10])
    with pytest.raises(UserError, match="distinct compute budgets"):
        plan(cfg, [1, 2], None, budgets=[1e10, 1e10])


def _params(cfg, index: int) -> int:
    """Parameters of size `index` of the recipe's model, as the models' registry counts them (byte tokens)."""
    fields = registry.resolve(cfg.model.model_copy(update=registry.scaled(cfg.model, index)), 257)
    return registry.parameters({"arch": cfg.model.architecture(), **fields})


def test_an_isoflop_plan_without_sizes_brackets_each_budgets_chinchilla_optimum_with_its_own_sizes(tmp_path):
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **{"model.n_embd": 16, "model.n_head": 1}))
    budgets = [1e11, 1e12, 1e13]  # Chinchilla's N* = sqrt(C / 120): 29k, 91k, 0.29M parameters
    p = plan(cfg, None, None, budgets=budgets)
    assert p.kind == "isoflop"
    chosen = {}
    for budget in budgets:
        rows = [t for t in p.trials if t["budget"] == budget]
        n = [_params(cfg, t["size"]) for t in rows]
        optimum = math.sqrt(budget / 120)
        assert len(set(n)) >= isoflop.MIN_POINTS and n == sorted(n), (budget, n)
        assert n[0] < optimum < n[-1], (budget, optimum, n)  # the parabola's vertex can lie inside the sizes
        assert n[-1] / n[0] <= 12 and all(b / a >= 1.2 for a, b in zip(n, n[1:])), n  # within a few times of N*
        for t, params in zip(rows, n):
            assert t["overrides"]["train.max_steps"] == isoflop.steps_for(budget, params, cfg.train.batch_tokens)
        chosen[budget] = [t["size"] for t in rows]
    assert chosen[1e11][0] < chosen[1e12][0] < chosen[1e13][0]  # a larger budget, larger sizes
    assert chosen[1e11] != chosen[1e13]
    explicit = plan(cfg, [2, 4, 8], None, budgets=budgets)  # --sizes: those at every budget
    assert [t["size"] for t in explicit.trials] == [2, 4, 8] * 3


def test_a_budget_too_small_for_the_narrowest_sizes_says_so_and_names_a_budget_that_plans(tmp_path):
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **{"model.n_embd": 16, "model.n_head": 1}))
    with pytest.raises(UserError, match=r"--budgets 1e\+08: the size its sizes centre on, sqrt\(C/120\)") as e:
        plan(cfg, None, None, budgets=[1e8])
    least = float(str(e.value).split("at least ")[1].split(" FLOPs")[0])
    assert least > 1e8
    assert plan(cfg, None, None, budgets=[least]).trials  # the budget it names brackets its optimum


def test_tokens_per_param_centres_each_budgets_sizes_on_the_size_trained_on_that_many_tokens(tmp_path):
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **{"model.n_embd": 16, "model.n_head": 1}))
    budgets = [1e12, 1e13]
    default = plan(cfg, None, None, budgets=budgets)
    lower = plan(cfg, None, None, budgets=budgets, tokens_per_param=180)  # N = sqrt(C / 1080): a third of Chinchilla's
    for budget in budgets:
        n = [_params(cfg, t["size"]) for t in lower.trials if t["budget"] == budget]
        chinchilla = [_params(cfg, t["size"]) for t in default.trials if t["budget"] == budget]
        assert n[0] < math.sqrt(budget / 1080) < n[-1], (budget, n)
        assert n[-1] < chinchilla[-1] and n[0] <= chinchilla[0], (n, chinchilla)
    for wrong in ({"budgets": None, "sizes": [1, 2, 3]}, {"budgets": budgets, "sizes": [1, 2, 3]}):
        with pytest.raises(UserError, match="--tokens-per-param centres each budget's own sizes"):
            plan(cfg, wrong.get("sizes"), None, budgets=wrong["budgets"], tokens_per_param=180)
    with pytest.raises(UserError, match="--tokens-per-param -1: give a positive number"):
        plan(cfg, None, None, budgets=budgets, tokens_per_param=-1)
