"""Operator commands of the `lmyard` command line: what a store holds, without running anything.

    lmyard runs [--store URI] [--json]                                the lineages of a store
    lmyard status RUN [--store URI] [--tracking-uri URI] [--json]     one lineage: checkpoint, attempts, lease,
                                                                      last evaluation, MLflow run, registered versions

The store and the tracking URI are the site's (defaults < LMYARD_* environment < the flags). `--json` prints
one JSON document (lmyard.tracking.runs' types) for scripts; without it, lines for a person.
"""

from __future__ import annotations

import argparse
import json


def add_parsers(sub) -> None:
    r = sub.add_parser("runs", help="list the lineages of a store")
    s = sub.add_parser("status", help="the state of one lineage")
    s.add_argument("run_name", metavar="RUN", help="the lineage's run_name")
    for p in (r, s):
        p.add_argument("--store", help="the store (default: LMYARD_STORE, else the default store)")
        p.add_argument("--json", action="store_true", help="one JSON document, for scripts")
    s.add_argument("--tracking-uri", help="the MLflow tracking URI (default: LMYARD_TRACKING__URI, else the default)")


def _config(args: argparse.Namespace):
    from lmyard.recipes import site_config

    overrides = [f"store={args.store}"] if args.store else []
    if getattr(args, "tracking_uri", None):
        overrides.append(f"tracking.uri={args.tracking_uri}")
    return site_config(overrides)


def runs(args: argparse.Namespace) -> int:
    from lmyard.run import Run
    from lmyard.tracking.runs import list_runs

    store = Run.of(_config(args)).store
    rows = list_runs(store)
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


def status(args: argparse.Namespace) -> int:
    from lmyard.run import Run
    from lmyard.tracking.runs import run_status

    cfg = _config(args)
    s = run_status(Run.of(cfg).store, args.run_name, cfg.tracking.uri)
    if args.json:
        print(s.model_dump_json(indent=1))
        return 0
    lines = [
        f"lineage {s.run_name}",
        f"  newest checkpoint: {s.newest_checkpoint or 'none'}"
        + (f" (step {s.newest_step}, {s.tokens_seen:,} tokens seen)" if s.tokens_seen is not None else ""),
        f"  lease: {s.lease.holder + (' (expired)' if s.lease.expired else '') if s.lease else 'not held'}",
        f"  MLflow run: {s.mlflow_run_id or '-'} {s.mlflow_status or ''} {s.mlflow_run_url or ''}".rstrip(),
    ]
    lines += [
        f"  attempt {a.number}: from step {a.start_step}"
        + (f" ({a.resumed_from})" if a.resumed_from else "")
        + f", {a.outcome or 'no outcome recorded'}"
        for a in s.attempts
    ]
    if s.last_evaluation:
        lines.append(f"  last evaluation: step {s.last_evaluation.step}, val loss {s.last_evaluation.val_loss:.4f}")
    lines += [
        f"  registered: {v.uri}" + (f" @{','.join(v.aliases)}" if v.aliases else "") for v in s.registered_versions
    ]
    print("\n".join(lines))
    return 0
