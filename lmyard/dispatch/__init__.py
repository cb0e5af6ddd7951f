"""The stage entrypoints, each a typed spec in and a typed result out: what the stage image runs.

    python -m lmyard.dispatch {shard,train,evaluate,export} [--spec spec.json] [--out result.json]

Every stage is a row of STAGES: its spec type (lmyard.stages: ShardSpec, TrainSpec, EvalSpec, ExportSpec) and
how it runs. The spec comes from `--spec`, or from LMYARD_SPEC in a container; the result or the StageError goes
atomically to `--out` (default: result.json in the exchange folder, LMYARD_EXCHANGE_DIR); the exit code follows
lmyard.errors.ExitCode (lmyard.stages.run_stage). Training runs under torchrun on every rank (rank 0 writes the
result, a failing rank its own file: lmyard.train.stage); the others as one process. The bodies live where
their subject does (lmyard.data.sharding, lmyard.train.stage, lmyard.evaluate.evaluator, lmyard.export.hf).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from lmyard import backends
from lmyard.config import RunConfig
from lmyard.stages import (
    EXCHANGE_ENV,
    EvalResult,
    EvalSpec,
    Exchange,
    ExportResult,
    ExportSpec,
    ShardProgress,
    ShardResult,
    ShardSpec,
    StageSpec,
    TrainSpec,
    read_spec,
    run_stage,
)

# the stages' output is a log a person reads line by line: third-party progress bars (tqdm: lm-eval, datasets,
# transformers, the Hugging Face hub) would each draw a line per update there; an operator's own setting wins
QUIET_BARS = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def _say(text: str) -> None:
    print(text, flush=True)


def shard(spec: ShardSpec) -> ShardResult:
    import dataclasses

    from lmyard.data import sharding

    exchange = Exchange.from_env()

    def progress(p: sharding.Progress) -> None:  # the launcher's on_progress reads it (a Prefect artifact)
        if exchange is not None:
            exchange.write("progress.json", ShardProgress(**dataclasses.asdict(p)))

    config, start_pool, pools = _on_ray(spec.config)
    shards, reused = sharding.tokenize_and_shard(config, log=_say, progress=progress, start_pool=start_pool)
    nodes = [n for p in pools for n in p.nodes]
    if nodes:
        _say(f"read {len(nodes)} pieces on {len(set(nodes))} Ray nodes")
    return ShardResult(
        shards=shards,
        reused=reused,
        train_tokens=shards.tokens("train"),
        val_tokens=shards.tokens("val"),
        ray_nodes=nodes,
    )


def _on_ray(config: RunConfig) -> tuple[RunConfig, Callable | None, list]:
    """On launch.backend=ray the read pieces run as Ray tasks over the cluster's nodes (lmyard.data.raypool), as
    many at a time as its CPUs (or data.num_proc): the config, the pool's maker, the pools it made."""
    pools: list = []
    if not backends.of(config).on_ray:
        return config, None, pools
    from lmyard.data import raypool

    def start(num_proc: int, initargs: tuple) -> raypool.RayPool:
        pools.append(raypool.RayPool(num_proc, initargs))
        return pools[-1]

    data = config.data.model_copy(update={"num_proc": config.data.num_proc or raypool.cluster_cpus()})
    return config.model_copy(update={"data": data}), start, pools


def evaluate(spec: EvalSpec) -> EvalResult:
    from lmyard.evaluate import evaluator

    return evaluator.evaluate_latest(spec.config, spec.shards, spec.step)  # the evaluate task says the result


def export(spec: ExportSpec) -> ExportResult:
    from lmyard.export import hf

    result = ExportResult.model_validate(hf.export(spec.source, spec.dest, spec.step))
    _say(f"exported {result.checkpoint} (step {result.step}) as {result.hf_architecture} to {result.uri}")
    return result


def train(spec_path: str | None, out: str | None) -> int:
    """Every rank, under torchrun: rank 0 writes result.json, a failing rank its own file (`out` is not used)."""
    from lmyard.train.stage import train_stage

    return train_stage(spec_path)


def one_process(cls: type[StageSpec], body: Callable[[Any], BaseModel]) -> Callable[[str | None, str | None], int]:
    """A stage of one process: its spec read, `body` run, its result or StageError written to `out`."""

    def run(spec_path: str | None, out: str | None) -> int:
        for key, value in QUIET_BARS.items():
            os.environ.setdefault(key, value)
        out = out or os.path.join(os.environ.get(EXCHANGE_ENV, "."), "result.json")
        # the spec is read inside run_stage: one that does not validate ends with a result file too
        return run_stage(lambda: body(read_spec(cls, spec_path)), out)

    return run


@dataclass(frozen=True)
class Stage:
    spec: type[StageSpec]
    run: Callable[[str | None, str | None], int]  # (--spec, --out) -> the exit code


STAGES: dict[str, Stage] = {
    s.spec.stage: s
    for s in (
        Stage(ShardSpec, one_process(ShardSpec, shard)),
        Stage(TrainSpec, train),
        Stage(EvalSpec, one_process(EvalSpec, evaluate)),
        Stage(ExportSpec, one_process(ExportSpec, export)),
    )
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmyard.dispatch", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=list(STAGES))
    p.add_argument("--spec", default=None, help="the stage's spec, a JSON file (default: $LMYARD_SPEC)")
    p.add_argument("--out", default=None, help="where the result goes (default: result.json in the exchange folder)")
    args = p.parse_args(argv)
    return STAGES[args.stage].run(args.spec, args.out)
