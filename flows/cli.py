"""The `lmyard` command line: run the pipeline's flows here.

Design notes: docs/cli.md, `flows/cli.py`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


class _NoTracebackForUserErrors(logging.Filter):
    """Prefect logs failed runs with their traceback; a user mistake, or a stage's failure (a crash, a stall),
    needs only its message: a traceback is kept for an error outside lmyard's, where the code went wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        from lmyard.errors import ExitCode, StageFailed, UserError, exit_code_of

        error = record.exc_info[1] if record.exc_info else None
        if error is not None and (
            isinstance(error, (UserError, StageFailed)) or exit_code_of(error) != ExitCode.CRASHED
        ):
            record.exc_info, record.exc_text = None, None
            record.error = error  # what the console says of it (lmyard.console: each failure said once)
        return True


def _quiet_user_errors() -> None:
    f = _NoTracebackForUserErrors()
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):  # "": the console (lmyard.console)
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(f)


class _Terminated(SystemExit):
    """SIGTERM to `lmyard run`: ends the command with 128 + 15, as a shell reports a terminated job."""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated(128 + signum)


def _parser() -> argparse.ArgumentParser:
    from lmyard import __version__

    p = argparse.ArgumentParser(prog="lmyard", description="Pretrain GPT-style language models.")
    p.add_argument("--version", action="version", version=f"lmyard {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("run", "run the pretrain flow"),
        ("shard", "tokenize-and-shard only"),
        ("config", "print the resolved config as YAML"),
        ("sweep", "train a recipe at several model sizes, or over a search space (docs/sweeps.md)"),
    ):
        s = sub.add_parser(name, help=help_)
        _recipe_arguments(s)
        if name == "config":
            s.add_argument("--reference", action="store_true", help="print the reference of every key (Markdown)")
        if name == "sweep":
            for flag, kw in SWEEP_FLAGS:  # --sizes, --search, --budgets
                s.add_argument(flag, default=None, **kw)
    _render_parser(sub)
    from flows import ops

    ops.add_parsers(sub)  # runs, status: what a store holds; eval, sample: what its models do
    e = sub.add_parser("export", help="a checkpoint as a Hugging Face transformers model folder")
    e.add_argument(
        "source",
        metavar="RUN_OR_CHECKPOINT_URI",
        help="STORE/runs/RUN (its newest complete checkpoint) or STORE/runs/RUN/checkpoints/step_NNNNNNNN",
    )
    e.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    e.add_argument(
        "--to",
        dest="dest",
        required=True,
        metavar="DIR_OR_S3_URI",
        help="a new (or empty) folder or s3://bucket/prefix",
    )
    return p


def _recipe_arguments(s: argparse.ArgumentParser) -> None:
    """RECIPE and its --set overrides, as every command that resolves a config takes them."""
    s.add_argument(
        "recipe",
        nargs="?",
        default="smoke",
        help="`smoke` (CPU default), a shipped recipe (lmyard/recipes) or deploy/recipes/NAME, or a YAML path",
    )
    s.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.max_steps=50 (repeatable)",
    )


def _render_parser(sub) -> None:
    r = sub.add_parser("render", help="Kubernetes manifests of a recipe, to apply with kubectl (docs/kubernetes.md)")
    r.add_argument(
        "target",
        choices=["k8s", "k8s-pool"],
        help="k8s: the train stage as a headless Service and an indexed Job (YAML); "
        "k8s-pool: a Prefect Kubernetes work pool's base job template (JSON)",
    )
    _recipe_arguments(r)
    r.add_argument(
        "--shards",
        metavar="ADDRESS",
        help="k8s: with the ConfigMap of the train stage's spec too, for this shard set of the store "
        "(the address `lmyard shard` prints)",
    )
    r.add_argument("--out", metavar="DIR", help="write one file per object into DIR instead of printing them")


def _indices(text: str) -> list[int]:
    try:
        return [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 1,2,3") from None


def _budgets(text: str) -> list[float]:
    try:
        return [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give FLOPs separated by commas, e.g. 1e15,3e15,1e16") from None


SWEEP_FLAGS: list[tuple[str, dict]] = [
    ("--sizes", {"type": _indices, "help": "scaling indices of the model, e.g. 1,2,3"}),
    ("--search", {"metavar": "FILE", "help": "a YAML search space (docs/sweeps.md)"}),
    (
        "--budgets",
        {
            "type": _budgets,
            "help": "an isoFLOP sweep: FLOPs (6ND), e.g. 1e15,3e15,1e16; each trains 5 sizes around its "
            "Chinchilla optimum sqrt(C/120) (with --sizes: those sizes at every budget)",
        },
    ),
    (
        "--tokens-per-param",
        {
            "type": float,
            "metavar": "R",
            "help": "with --budgets: centre each budget's sizes on sqrt(C/6R), the size trained on R tokens a "
            "parameter (default 20, Chinchilla's); more than 20 for small models limited by their steps",
        },
    ),
]


def _sweep_parameters(args: argparse.Namespace, config) -> dict:
    """The sweep flow's sizes or search space, checked here (one line, exit 2) before Prefect starts."""
    from prefect.settings import PREFECT_API_URL

    from lmyard.sweep.driver import check_cluster, plan
    from lmyard.sweep.space import read_space

    search = None
    if args.search is not None:
        read_space(args.search)  # the file's own mistakes name the file
        import yaml

        with open(args.search) as f:
            search = yaml.safe_load(f)
    trials = plan(config, args.sizes, search, f"--search {args.search}", args.budgets, args.tokens_per_param)
    check_cluster(config, trials, PREFECT_API_URL.value())  # unset: lmyard's temporary server, on 127.0.0.1
    isoflop = {"budgets": args.budgets, "tokens_per_param": args.tokens_per_param}
    return {"sizes": args.sizes, "search": search} | {k: v for k, v in isoflop.items() if v is not None}


def _export(args: argparse.Namespace) -> int:
    from lmyard.export.hf import export  # imports torch: only for this command
    from lmyard.stages import ExportResult

    info = ExportResult.model_validate(export(args.source, args.dest, args.step))
    print(f"lmyard: exported {info.checkpoint} (step {info.step}) as {info.hf_architecture} to {info.uri}")
    return 0


def _settle_prefect() -> None:
    """Prefect sends its events to the server from its own thread, drained at the interpreter's exit; drained here,
    so that what Prefect says of them (a connection lost while the flow was paused) comes before lmyard's last line.
    """
    if "prefect.events.worker" in sys.modules:
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=5)


def _failed(error: BaseException, code: int, kind: str = "") -> int:
    """The last line of a failed command: the error, once (the console prints nothing more of it)."""
    from lmyard import console

    _settle_prefect()
    console.settle(error)
    print(f"lmyard: error: {kind}{console.headline(error)}", file=sys.stderr)
    return code


def _command(args: argparse.Namespace) -> int:
    """Every command but the flows' is quick and starts nothing; run and shard run their flow (_run_flow)."""
    from lmyard.recipes import load_recipe

    if args.command in ("runs", "status", "eval", "sample", "export"):
        from lmyard import console
        from lmyard.tracking.client import operator_timeouts

        operator_timeouts()  # a tracking server that stops answering ends the command in seconds, not minutes
        console.quiet_tools()  # MLflow's INFO lines (a new sqlite database's) are not the command's output
    if args.command == "export":
        return _export(args)
    if args.command in ("runs", "status", "eval", "sample"):
        from flows import ops

        return {"runs": ops.runs, "status": ops.status, "eval": ops.evaluate, "sample": ops.sample}[args.command](args)
    if args.command == "config" and args.reference:
        from lmyard.config_reference import reference_markdown

        print(reference_markdown())
        return 0
    config = load_recipe(args.recipe, args.overrides)
    if args.command == "config":
        import yaml

        print(yaml.safe_dump(config.redacted_dump(), sort_keys=False), end="")
        return 0
    if args.command == "render":
        return _render(args, config)
    extra = _sweep_parameters(args, config) if args.command == "sweep" else {}
    return _run_flow(args.command, config, **extra)


def _render(args: argparse.Namespace, config) -> int:
    """`lmyard render`: the manifests on stdout, or one file each in --out DIR; nothing is applied."""
    import json

    import yaml

    from lmyard.errors import UserError
    from lmyard.launch import kubernetes

    if args.target == "k8s-pool":
        if args.shards:
            raise UserError("--shards is for `lmyard render k8s`: the pool's flow runs shard the data themselves")
        files = {"pool.json": json.dumps(kubernetes.pool_template(config), indent=2) + "\n"}
    else:
        shards = kubernetes.shard_set(config, args.shards) if args.shards else None
        objects = kubernetes.training_objects(config, shards)
        files = {f"{o['kind'].lower()}.yaml": yaml.safe_dump(o, sort_keys=False) for o in objects}
    if args.out is None:
        print("---\n".join(files.values()), end="")
        return 0
    os.makedirs(args.out, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
        print(f"lmyard: wrote {os.path.join(args.out, name)}")
    return 0


def _run_flow(command: str, config, **parameters) -> int:
    """The pretrain flow (`run`) or the shard flow (`shard`) here, on Prefect's temporary server unless
    PREFECT_API_URL names one; its last lines."""
    from prefect import tags

    from flows.prefect_server import start_temporary_server
    from lmyard import console
    from lmyard.errors import StageFailed, UserError
    from lmyard.run import Run
    from lmyard.tracking.client import check_reachable
    from lmyard.tracking.credentials import credentials_to_env

    # a read-only store (or its runs/) fails here, before Prefect starts
    run = Run.of(config)
    run.store.check_writable(*([run.layout.root] if command == "run" else []))
    if command != "shard":  # the tracking server answers, before any shard or Prefect server is made
        check_reachable(config.tracking.uri)
    # Offline-friendly Prefect defaults; an operator's own settings win.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if command == "run":
        from flows.pretrain import pretrain as flow_fn
    elif command == "sweep":
        from flows.sweep import sweep as flow_fn  # type: ignore[assignment]  # all take config=
    else:
        from flows.shard import shard as flow_fn  # type: ignore[assignment]
    console.install(config.store)  # what a person reads: lmyard/console.py
    _quiet_user_errors()
    start_temporary_server()  # out of reach of the terminal's Ctrl-C, so the run can record how it ended
    # Prefect's flow engine turns a SIGTERM into its TerminationSignal (the flow stops its trainers, which
    # checkpoint, and records the end), then sends it again to the handler it found: this one, so the command
    # ends with its one line and 143 rather than dying by the signal
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tags("lmyard"):  # as every deployment's runs: lmyard's automations act on this tag only
        try:  # the tracking password goes to the environment before the config becomes the flow run's parameter
            result = flow_fn(config=credentials_to_env(config), **parameters)
        except (UserError, StageFailed):
            raise
        except Exception as e:  # a flaw of the code: the console printed its traceback once, above
            return _failed(e, 1, f"{type(e).__name__}: ")
    console.settle(None)  # a failure the flow went on from (an evaluation) prints before the result
    return _said(command, config, result)


def _said(command: str, config, result) -> int:
    """The last lines of a flow that ended: the shard set, the sweep or the run, and where to look next."""
    from lmyard import console
    from lmyard.data.shardset import ShardSet

    if isinstance(result, ShardSet):  # `lmyard shard`
        print(f"lmyard: shard set {result.address} at {result.uri}")
        return 0
    if command == "sweep":
        print(f"lmyard: sweep {result.run_name} finished (MLflow run {result.mlflow_run_id})")  # its summary: above
        for line in result.recommended:  # an isoFLOP sweep's compute-optimal sizes
            print(f"lmyard: {line}")
        print(f"lmyard: {console.where_next(config.tracking.uri, result.mlflow_run_id, None)}")
        return 0
    val = f"val loss {result.val_loss:.4f}" if result.val_loss is not None else "no val loss"
    failed = f"; evaluation failed at steps {sorted(result.failed_evaluations)}" if result.failed_evaluations else ""
    print(
        f"lmyard: {result.run_name} finished at step {result.steps}: {val} (MLflow run {result.mlflow_run_id}){failed}"
    )
    print(f"lmyard: {console.where_next(config.tracking.uri, result.mlflow_run_id, result.registered_model)}")
    return 0


def _printing(args: argparse.Namespace) -> int:
    """A command that prints and ends (config, runs, status, eval, sample, export): a reader that stops early
    (`lmyard config --reference | head`) ends it quietly, as for any tool. Only here: in a flow's process a broken
    connection must stay an error, never a silent SIGPIPE death."""
    try:
        code = _command(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more reaches the closed pipe
        return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    # Prefect's client telemetry (and its first-run notice) is off unless the operator turns it on (DO_NOT_TRACK=0)
    os.environ.setdefault("DO_NOT_TRACK", "1")
    args = _parser().parse_args(argv)
    from lmyard.errors import StageFailed, UserError

    try:
        if args.command in ("run", "shard", "sweep"):
            return _command(args)
        return _printing(args)
    except (UserError, StageFailed) as e:  # one line each, the last: its exit code
        return _failed(e, int(e.exit_code))
    except KeyboardInterrupt:
        _settle_prefect()
        print("lmyard: interrupted; run the same command again to resume from the latest checkpoint", file=sys.stderr)
        return 130
    except _Terminated as e:
        _settle_prefect()
        print("lmyard: terminated; run the same command again to resume from the latest checkpoint", file=sys.stderr)
        return int(e.code or 143)


if __name__ == "__main__":
    sys.exit(main())
