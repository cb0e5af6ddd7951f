"""Operator commands of the `lmyard` command line: what a store holds and what its models do, without a flow.

    lmyard runs [--store URI] [--json]                        the lineages of a store
    lmyard status RUN [--verify] [--json]                     one lineage: checkpoint, attempts, lease, evaluation
    lmyard eval SOURCE [--step N] [--tasks T,...] [--json]    val loss, HellaSwag, lm-eval tasks on a model
    lmyard sample SOURCE --prompt TEXT [--json]               completions of prompts

Design notes: docs/operations.md, `flows/ops.py`.
"""

from __future__ import annotations

import argparse
import json
import os


def add_parsers(sub) -> None:
    r = sub.add_parser("runs", help="list the lineages of a store")
    s = sub.add_parser("status", help="the state of one lineage")
    s.add_argument("run_name", metavar="RUN", help="the lineage's run_name")
    s.add_argument("--verify", action="store_true", help="check the newest checkpoint's checksums (reads it all)")
    for p in (r, s):
        p.add_argument("--store", help="the store (default: LMYARD_STORE, else the default store)")
        p.add_argument("--json", action="store_true", help="one JSON document, for scripts")
    e = sub.add_parser("eval", help="evaluate a checkpoint, an export or a registered model")
    e.add_argument(
        "--tasks",
        type=_tasks,
        default=None,
        help="comma-separated: val_loss, hellaswag (lmyard's scorer of --hellaswag), or lm-eval task names "
        "(default: val_loss, and hellaswag with --hellaswag)",
    )
    e.add_argument("--hellaswag", metavar="FILE", help="a HellaSwag-format JSONL (ctx, endings, label), path or s3://")
    e.add_argument("--log", action="store_true", help="log the results to the lineage's MLflow run (else a new run)")
    m = sub.add_parser("sample", help="complete prompts with a checkpoint, an export or a registered model")
    m.add_argument("--prompt", dest="prompts", action="append", required=True, help="a prompt (repeatable)")
    m.add_argument("--max-new-tokens", type=_at_least(0, int), default=64)
    m.add_argument("--temperature", type=_positive, default=0.8)
    m.add_argument("--top-k", type=_at_least(1, int), default=40)
    m.add_argument("--seed", type=int, default=0)
    for p in (e, m):
        p.add_argument(
            "source", metavar="SOURCE", help="RUN, STORE/runs/RUN[/checkpoints/step_N], a folder, models:/..."
        )
        p.add_argument("--step", type=_at_least(0, int), default=None, help="the checkpoint's step (default: newest)")
        p.add_argument("--store", help="the store (default: LMYARD_STORE, else the default store)")
        p.add_argument("--device", default="cpu", type=_device, help="cpu (default) or cuda[:N]")
        p.add_argument("--json", action="store_true", help="one JSON document, for scripts")
    r.add_argument("--cost", action="store_true", help="total the lineages' GPU-hours and node-hours by experiment")
    for p in (r, s, e, m):
        p.add_argument(
            "--tracking-uri", help="the MLflow tracking URI (default: LMYARD_TRACKING__URI, else the default)"
        )


def _tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError("give at least one task, e.g. --tasks val_loss,hellaswag")
    return tasks


def _at_least(low: int, kind=int):
    def parse(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _device(text: str) -> str:
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu or cuda[:N]")
    return text


def _config(args: argparse.Namespace, tracking: bool = False):
    """The site's config with the command's flags; with `tracking`, its MLflow server answers (one line in
    seconds when it does not: lmyard.tracking.client)."""
    from lmyard.recipes import site_config
    from lmyard.tracking.client import check_reachable

    overrides = [f"store={args.store}"] if args.store else []
    if getattr(args, "tracking_uri", None):
        overrides.append(f"tracking.uri={args.tracking_uri}")
    cfg = site_config(overrides)
    if tracking:
        check_reachable(cfg.tracking.uri)
    return cfg


def _store(cfg):
    """The config's store, which must exist (one line naming it when it does not)."""
    from lmyard.run import Run
    from lmyard.tracking.runs import check_store

    store = Run.of(cfg).store
    check_store(store)
    return store


def runs(args: argparse.Namespace) -> int:
    from lmyard.tracking.runs import list_runs

    cfg = _config(args)
    store = _store(cfg)
    rows = list_runs(store)
    if args.cost:
        return _cost(store, rows, cfg.tracking.uri, args.json)
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in rows], indent=1))
        return 0
    if not rows:
        print(f"no lineages in {store.uri('runs')}")
    for r in rows:
        held = f"held by {r.lease.holder}" if r.lease and not r.lease.expired else "not held"
        newest = f"step {r.newest_step}" if r.newest_step is not None else "no checkpoint"
        print(f"{r.run_name}: {newest} ({r.checkpoints} checkpoints), {held}, MLflow run {r.mlflow_run_id or '-'}")
    return 0


def _cost(store, rows, tracking_uri: str, as_json: bool) -> int:
    """`lmyard runs --cost`: each experiment's lineages of the store, their usage summed (lmyard.tracking.cost)."""
    from lmyard.tracking.runs import usage_by_experiment

    totals = usage_by_experiment(store, rows, tracking_uri)
    if as_json:
        print(json.dumps({k: {"lineages": n, **u.model_dump()} for k, (n, u) in totals.items()}, indent=1))
        return 0
    for experiment, (n, usage) in sorted(totals.items()):
        print(f"{experiment}: {n} lineage{'s' if n != 1 else ''}, {usage.words()}")
    if not totals:
        print(f"no lineage of {store.uri('runs')} has an MLflow run")
    return 0


def status(args: argparse.Namespace) -> int:
    from lmyard.run import Run
    from lmyard.tracking.runs import run_status

    cfg = _config(args, tracking=True)
    s = run_status(Run(args.run_name, _store(cfg)), cfg.tracking.uri, checksums=args.verify)
    if args.json:
        print(s.model_dump_json(indent=1))
        return 0
    lines = [
        f"lineage {s.run_name}",
        f"  newest checkpoint: {s.newest_checkpoint or 'none'}"
        + (f" (step {s.newest_step}, {s.tokens_seen:,} tokens seen)" if s.tokens_seen is not None else "")
        + (f" DAMAGED ({s.newest_damaged})" if s.newest_damaged else ""),
        f"  lease: {s.lease.holder + (' (expired)' if s.lease.expired else '') if s.lease else 'not held'}",
        f"  MLflow run: {s.mlflow_run_id or '-'} {s.mlflow_status or ''} {s.mlflow_run_url or ''}".rstrip(),
    ]
    if s.flow_run_url:
        lines.append(f"  flow run: {s.flow_run_url}")
    sized = any(a.resized for a in s.attempts)  # a lineage that changed size: each attempt's nodes and steps
    lines += [_attempt_line(a, sized) for a in s.attempts]
    if s.damaged_steps:
        lines.append(f"  moved aside as damaged: steps {s.damaged_steps}")
    if s.usage is not None and s.attempts:
        lines.append(f"  usage: {s.usage.words()}")
    lines += _restart_lines(s)
    if last := s.last_evaluation:
        rows = last.rows or {"val loss": f"{last.val_loss:.4f}"}
        lines.append(f"  last evaluation: step {last.step}, " + ", ".join(f"{k} {v}" for k, v in rows.items()))
    lines += [
        f"  registered: {v.uri}" + (f" @{','.join(v.aliases)}" if v.aliases else "") for v in s.registered_versions
    ]
    print("\n".join(lines))
    return 0


def _restart_lines(s) -> list[str]:
    """Each attempt's restart in its parts (system/restart/*), and the lineage's goodput with its badput by cause."""
    lines = [
        f"    restart of attempt {a.number}: {a.restart_s['total']:.1f} s = "
        + " + ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in a.restart_s.items() if k != "total" and v >= 0.05)
        for a in s.attempts
        if "total" in a.restart_s
    ]
    if g := s.goodput:
        lines.append(
            f"  goodput {g.goodput:.1%} ({g.productive_s:.0f} s of {g.wall_s:.0f} s); badput: "
            + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in g.badput_s.items())
        )
    return lines


def _attempt_line(a, sized: bool) -> str:
    return (
        f"  attempt {a.number}: from step {a.start_step}"
        + (f" ({a.resumed_from})" if a.resumed_from else "")
        + (f", {a.nodes} nodes ({a.hosts})" if sized and a.nodes else "")
        + (f", {a.steps} steps" if sized and a.steps is not None else "")
        + (f", resized: {a.resized}" if a.resized else "")
        + f", {a.outcome or 'no outcome recorded'}"
        + (f" ({a.wall_s:,.0f} s on {a.nodes} node(s) x {a.gpus_per_node} GPUs)" if a.wall_s is not None else "")
    )


def _model(args: argparse.Namespace, tasks: list[str] | None = None, hellaswag: str | None = None):
    """The source resolved and checked (one line on a mistake), then its model loaded: (source, loaded, device)."""
    from lmyard.config import EvalConfig
    from lmyard.data.loader import default_cache_dir
    from lmyard.evaluate import ondemand
    from lmyard.tracking.registered import is_registered

    cfg = _config(args, tracking=is_registered(args.source) or getattr(args, "log", False))
    src = ondemand.resolve(args.source, args.step, cfg.store, cfg.tracking.uri)
    if tasks is not None:
        ondemand.check_tasks(tasks, hellaswag)
    from lmyard.evaluate.evaluator import device_for  # imports torch: past every check

    device = device_for(EvalConfig(device=args.device))
    cache = os.path.join(default_cache_dir(), "ondemand")
    return src, ondemand.load(src, device, cache, cfg.tracking.uri), device, cfg


def evaluate(args: argparse.Namespace) -> int:
    from lmyard.data.loader import default_cache_dir
    from lmyard.evaluate import ondemand

    tasks = args.tasks or ["val_loss", *(["hellaswag"] if args.hellaswag else [])]
    src, loaded, device, cfg = _model(args, tasks, args.hellaswag)
    result = ondemand.evaluate(src, loaded, tasks, args.hellaswag, device, default_cache_dir())
    if args.log:
        result["mlflow_run_id"] = ondemand.log(result, src, cfg.tracking.uri, cfg.tracking.experiment)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    step = f" step {result['step']}" if result["step"] is not None else ""
    lines = [f"{src.run_name or src.given}{step}: {result['model']} ({result['eval_s']:.1f} s on {device})"]
    lines += [f"  {k}: {v:.4f}" for k, v in result["metrics"].items()]
    lines += [f"  note: {n}" for n in result["notes"]]
    if args.log:
        lines.append(f"  logged to MLflow run {result['mlflow_run_id']} as {ondemand.LOGGED_PREFIX}*")
    print("\n".join(lines))
    return 0


def sample(args: argparse.Namespace) -> int:
    from lmyard.evaluate.evals import complete

    src, m, device, _ = _model(args)
    done = complete(m.model, m.enc, args.prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed, device)
    out = [{"prompt": c.prompt, "completion": c.completion} for c in done.items]
    if args.json:
        print(json.dumps({"source": src.given, "step": m.step, "seed": args.seed, "samples": out}, indent=1))
        return 0
    print("\n\n".join(f"{s['prompt']}{s['completion']}" for s in out))
    return 0
