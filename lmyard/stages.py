"""The pipeline's stages without Prefect: what the stage image runs besides the trainer.

    python -m lmyard.stages shard RECIPE [--set dotted.key=value ...] [--out result.json]
    python -m lmyard.stages evaluate RECIPE [--step N] [--set ...] [--out result.json]

`shard` tokenizes config.data into the store (or reuses the shard set at its
address); `evaluate` scores checkpoint N (default: the newest complete one) of
config.run_name on that shard set and samples it. The result (ShardResult,
EvalResult of lmyard.contracts) or the failure (StageError) is written
atomically to `--out` (default: result.json in LMYARD_EXCHANGE_DIR or the
current folder), and the exit code follows lmyard.errors.ExitCode: 0 done,
2 a user error. The log says what happens, for people. The trainer is
`torchrun ... -m lmyard.train` (see lmyard.launch).
"""

from __future__ import annotations

import argparse
import os
import sys

from lmyard.contracts import EXCHANGE_ENV, ShardResult, run_stage
from lmyard.data.shards import ShardSet
from lmyard.recipes import load_recipe


def _shard(cfg, log) -> tuple[ShardResult, ShardSet]:
    from lmyard.data import sharding

    shards, reused = sharding.tokenize_and_shard(cfg, log=log)
    return ShardResult(
        address=shards.address,
        uri=shards.uri,
        reused=reused,
        train_tokens=shards.tokens("train"),
        val_tokens=shards.tokens("val"),
    ), shards


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmyard.stages", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["shard", "evaluate"])
    p.add_argument("recipe", help="`smoke`, a name under deploy/recipes, or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--step", type=int, default=None, help="evaluate: the checkpoint's step (default: the newest)")
    p.add_argument("--out", default=None, help="where the result file goes")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.environ.get(EXCHANGE_ENV, "."), "result.json")
    say = lambda s: print(s, flush=True)

    def produce():
        cfg = load_recipe(args.recipe, args.overrides)
        result, shards = _shard(cfg, say)
        if args.stage == "shard":
            say(f"shard set {result.address} at {result.uri} ({result.train_tokens:,} train tokens)")
            return result
        from lmyard.evaluate import evals

        evaluation = evals.evaluate_latest(cfg, shards, args.step)
        say(f"step {evaluation.step}: val loss {evaluation.val_loss:.4f} ({evaluation.checkpoint})")
        return evaluation

    return run_stage(out, produce)


if __name__ == "__main__":
    sys.exit(main())
