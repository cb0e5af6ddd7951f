"""The pipeline's stages without Prefect: what the stage image runs besides the trainer.

    python -m lmyard.stages shard RECIPE [--set dotted.key=value ...]
    python -m lmyard.stages evaluate RECIPE [--set ...]

`shard` tokenizes config.data into the store (or reuses the shard set at its
address); `evaluate` scores the newest checkpoint of config.run_name on that
shard set and samples it. Each prints one JSON line `result {...}` last;
a user mistake prints `lmyard: error: ...` and exits 2. The trainer is
`torchrun ... -m lmyard.train` (see lmyard.launch_docker).
"""

from __future__ import annotations

import argparse
import json
import sys

from lmyard.config import load_recipe
from lmyard.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmyard.stages", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["shard", "evaluate"])
    p.add_argument("recipe", help="`smoke`, a name under deploy/recipes, or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from lmyard import sharding

    try:
        cfg = load_recipe(args.recipe, args.overrides)
        shards, reused = sharding.tokenize_and_shard(cfg, log=lambda s: print(s, flush=True))
        if args.stage == "shard":
            result = {"address": shards.address, "reused": reused, "train_tokens": shards.tokens("train"),
                      "val_tokens": shards.tokens("val")}
        else:
            from lmyard import evals

            result = evals.evaluate_latest(cfg, shards)
    except UserError as e:
        print(f"lmyard: error: {e}", file=sys.stderr)
        return 2
    print("result " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
