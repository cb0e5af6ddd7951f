"""The `lmyard` command line: run the pipeline's flows here.

    lmyard run RECIPE [--set dotted.key=value ...]     the pretrain flow
    lmyard shard RECIPE [--set dotted.key=value ...]   tokenize-and-shard only
    lmyard config [RECIPE] [--set ...]                 print the resolved config (YAML)
    lmyard --version                                   the package version
    lmyard export RUN_OR_CHECKPOINT_URI [--step N] --to DIR_OR_S3_URI
                                                       a checkpoint as a Hugging Face model folder

RECIPE is a built-in name (`smoke`, the CPU default) or a YAML path.
User mistakes print one line, `lmyard: error: ...`, and exit 2; a diverged run exits 3, a store
outage or a full cache disk 4, a preempted run 5 (lmyard.errors.ExitCode). A failed run's last line is
that one line, whatever ended it (a crash exits 1), said once (lmyard.console).
"""

from __future__ import annotations

import argparse
import logging
import os
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


def _parser() -> argparse.ArgumentParser:
    from lmyard import __version__

    p = argparse.ArgumentParser(prog="lmyard", description="Pretrain GPT-style language models.")
    p.add_argument("--version", action="version", version=f"lmyard {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("run", "run the pretrain flow"),
        ("shard", "tokenize-and-shard only"),
        ("config", "print the resolved config as YAML"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument(
            "recipe",
            nargs="?" if name == "config" else None,
            default="smoke",
            help="`smoke` (CPU default), another name under deploy/recipes, or a YAML path",
        )
        s.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set train.max_steps=50 (repeatable)",
        )
        if name == "config":
            s.add_argument("--reference", action="store_true", help="print the reference of every key (Markdown)")
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


def _export(args: argparse.Namespace) -> int:
    from lmyard.contracts import ExportResult
    from lmyard.export.hf import export  # imports torch: only for this command

    info = ExportResult.model_validate(export(args.source, args.dest, args.step))
    print(f"lmyard: exported {info.checkpoint} (step {info.step}) as {info.hf_architecture} to {info.uri}")
    return 0


def _failed(error: BaseException, code: int, kind: str = "") -> int:
    """The last line of a failed command: the error, once (the console prints nothing more of it)."""
    from lmyard import console

    console.settle(error)
    print(f"lmyard: error: {kind}{console.headline(error)}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from lmyard.contracts import ShardSet
    from lmyard.errors import StageFailed, UserError
    from lmyard.recipes import load_recipe

    running = False  # the flow runs: the console prints its failures
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "config" and args.reference:
            from lmyard.config_reference import reference_markdown

            print(reference_markdown())
            return 0
        config = load_recipe(args.recipe, args.overrides)
        if args.command == "config":
            import yaml

            print(yaml.safe_dump(config.redacted_dump(), sort_keys=False), end="")
            return 0
        from lmyard.layout import RunLayout
        from lmyard.store import open_store

        # a read-only store (or its runs/) fails here, before Prefect starts
        run_folder = [RunLayout(config.run_name).root] if args.command == "run" else []
        open_store(config.store).check_writable(*run_folder)
        # Offline-friendly Prefect defaults; an operator's own settings win.
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        if args.command == "run":
            from flows.pretrain import pretrain as flow_fn
        else:
            from flows.shard import shard as flow_fn  # type: ignore[assignment]  # both take config=, return a dict
        from flows.prefect_server import start_temporary_server
        from lmyard import console
        from lmyard.tracking.credentials import credentials_to_env

        console.install(config.store)  # what a person reads: lmyard/console.py
        _quiet_user_errors()
        start_temporary_server()  # out of reach of the terminal's Ctrl-C, so the run can record how it ended
        # the tracking password goes to the environment before the config becomes the flow run's parameter
        running = True
        result = flow_fn(config=credentials_to_env(config))
    except (UserError, StageFailed) as e:  # one line each, the last: its exit code
        return _failed(e, int(e.exit_code))
    except Exception as e:  # a flaw of the code: the console printed its traceback once, above
        if not running:
            raise
        return _failed(e, 1, f"{type(e).__name__}: ")
    except KeyboardInterrupt:
        print("lmyard: interrupted; run the same command again to resume from the latest checkpoint", file=sys.stderr)
        return 130
    from lmyard.console import settle, where_next

    settle(None)  # a failure the flow went on from (an evaluation) prints before the result
    if args.command == "run":
        val = f"val loss {result.val_loss:.4f}" if result.val_loss is not None else "no val loss"
        failed = (
            f"; evaluation failed at steps {sorted(result.failed_evaluations)}" if result.failed_evaluations else ""
        )
        print(
            f"lmyard: {result.run_name} finished at step {result.steps}: {val} "
            f"(MLflow run {result.mlflow_run_id}){failed}"
        )
        print(f"lmyard: {where_next(config.tracking.uri, result.mlflow_run_id, result.registered_model)}")
    else:
        assert isinstance(result, ShardSet)  # `lmyard shard` returns the shard set
        print(f"lmyard: shard set {result.address} at {result.uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
