"""The compute-optimal size on one GPU: an isoFLOP sweep of GPT-2 sizes, fitted as `lmyard sweep --budgets` fits it.

    python tests/benchmarks/bench_isoflop.py --out OUT                                  # one H200, ~4-6 minutes
    python tests/benchmarks/bench_isoflop.py --out OUT --device cpu --budgets 2e10,4e10,8e10 --n-embd 8 --n-layer 2 \
        --block-size 64 --batch-tokens 4096 --val-tokens 4096 --corpus-mb 1 --tokens-per-param 40 --jobs 2   # CPU
    python tests/benchmarks/bench_isoflop.py --plot OUT/isoflop.json                    # the plot, where matplotlib is

The trials are lmyard.sweep.space.isoflop_trials' (the sweep's own plan, as `lmyard sweep --budgets
--tokens-per-param R` makes it): at each budget C of `--budgets` the scaling indices (GPT-2, width and heads x
index, `--n-layer` blocks fixed) nearest 5 targets N x 1.7^k, k = -2..2, around N = sqrt(C / 6R), the size trained
on R tokens a parameter (`--tokens-per-param`, 160: these step-limited sizes have their optimum far above
Chinchilla's 20; `--sizes 1,2,3`: those at every budget instead); train.max_steps set so that 6 N D = C. Each
trains through lmyard's Trainer (bench_parity.lmyard_run: no Prefect, no MLflow), `--jobs` trials at once in
processes of their own (the most steps first), on the installed packages' docstrings
(bench_time_to_target.write_docs_corpus, read in a shuffled order: the corpus ends on documentation files) in
lmyard's byte-level tokens (257 symbols), uncompiled (~16 shapes: compiles would cost more than the runs), lr
2e-3 warmed up over a tenth of the steps (at most 40), cosine to 0.1. The last val loss of each is fitted by
lmyard.sweep.isoflop (the sweep's fit): a parabola in ln N per budget, its vertex the optimum, then N* = k C^a over
the budgets with its R². After every trial OUT/isoflop.json holds the points and the fit so far; at the end the
fit's lines print and OUT/loss_vs_compute.png is drawn (where matplotlib is installed; else `--plot` draws it).

Default arithmetic: width 16 a head x index, 4 blocks, T=256; budgets 3e12, 1e13, 3e13, 1e14 (centres 56k, 0.10M,
0.18M, 0.32M parameters); 8,192 tokens a step. The plan: 16 trials, 22k-0.87M parameters, 433-14,446 steps each,
~69,000 steps in all. An eager step of these widths costs ~12-14 ms on an H200 alone (launch-bound), 22-27 ms with
16 processes on the GPU: the longest trial (~315 s) sets the time. Measured on an H200, 2026-12-02: 241 s with
`--jobs 12`, 351 s with 8 beside a second sweep (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from lmyard.sweep import isoflop  # noqa: E402


def settings(a: argparse.Namespace, work: Path, corpus: Path) -> list[str]:
    return [
        f"store={work / 'store'}",
        f"data.source={corpus}",
        "data.val_every=50",
        "data.shuffle_sequences=true",  # each trial reads a sample of the whole split, however far it reads
        "model.arch=gpt2",
        f"model.n_layer={a.n_layer}",
        f"model.n_embd={a.n_embd}",
        "model.n_head=1",
        f"model.block_size={a.block_size}",
        f"train.device={a.device}",
        "train.compile=false",
        f"train.batch_tokens={a.batch_tokens}",
        f"train.micro_batch={a.batch_tokens // a.block_size}",
        "train.lr=2e-3",
        "train.log_interval=1000000",
        "eval.interval=1000000",  # validated at the last step only
        f"eval.val_tokens={a.val_tokens}",
        "checkpoint.interval=1000000",
        *a.overrides,
    ]


def fitted(points: list[isoflop.Point], sizes: dict[int, float]) -> dict:
    f = isoflop.fit(points)
    return {
        "exponent": f.exponent,
        "coefficient": f.coefficient,
        "r2": f.r2,
        "note": f.note,
        "optima": [{"budget": o.budget, "params": o.params, "loss": o.loss, "note": o.note} for o in f.optima],
        "lines": isoflop.describe(f, sizes),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for isoflop.json and loss_vs_compute.png")
    p.add_argument("--plot", default=None, metavar="ISOFLOP_JSON", help="only draw the plot of a finished run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="scaling indices at every budget (default: each budget's own, around its optimum)")  # fmt: skip
    p.add_argument("--budgets", type=lambda v: [float(x) for x in v.split(",")], default=[3e12, 1e13, 3e13, 1e14])
    p.add_argument("--n-embd", type=int, default=16, help="the width of size 1 (one head of that width)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--val-tokens", type=int, default=262144)
    p.add_argument("--corpus-mb", type=float, default=300.0, help="text to tokenize (bytes: 1 token a byte)")
    p.add_argument("--tokens-per-param", type=float, default=160.0,
                   help="each budget's sizes centre on N = sqrt(C / 6r) at this r (Chinchilla's is 20)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=8,
                   help="trials trained at once, one process each (launch-bound steps share the GPU well)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    if a.plot:
        saved = json.loads(Path(a.plot).read_text())
        fit = isoflop.fit([isoflop.Point(**pt) for pt in saved["points"]])
        path = Path(a.plot).with_name("loss_vs_compute.png")
        print(f"plot: {path}" if isoflop.plot(fit, str(path)) else "no plot: matplotlib is not installed")
        return
    if not a.out:
        p.error("--out is required (or --plot)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="isoflop-") as tmp:
        run(a, Path(tmp), out)


def run(a: argparse.Namespace, work: Path, out: Path) -> None:
    from bench_pylib import corpus_shards
    from bench_time_to_target import write_docs_corpus

    from lmyard.data.shardset import ShardSet
    from lmyard.recipes import load_recipe
    from lmyard.sweep.space import isoflop_trials, trial_config

    started = time.perf_counter()
    os.environ.setdefault("LMYARD_CACHE", str(work / "cache"))
    corpus = work / "docs.jsonl"
    said = write_docs_corpus(corpus, a.corpus_mb)
    base = load_recipe("smoke", settings(a, work, corpus))
    shard_dict, report = corpus_shards(base, work)
    shards = ShardSet.from_dict(shard_dict)
    print(json.dumps({"corpus": said, "shards": report}), flush=True)
    trials = isoflop_trials(base, a.sizes, a.budgets, shards.n_vocab, a.tokens_per_param)
    jobs = []
    for t in trials:
        data = trial_config(base, t)
        steps = data["train"]["max_steps"]
        data["train"]["warmup_steps"] = max(1, min(40, steps // 10))
        jobs.append((t, data))
    points: list[isoflop.Point] = []
    rows: list[dict] = []
    sizes: dict[int, float] = {}
    for t, row in _train_all(jobs, shard_dict, a.jobs, work):
        sizes[t.size or 0] = row["params"]
        points.append(isoflop.Point(t.budget or 0.0, row["params"], row["val_loss"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = {"elapsed_s": round(time.perf_counter() - started, 1), "tokens_per_param": a.tokens_per_param,
                  "rows": rows, "points": [vars(pt) for pt in points], "fit": fitted(points, sizes)}  # fmt: skip
        (out / "isoflop.json").write_text(json.dumps(result, indent=1))
    fit = isoflop.fit(points)
    for line in isoflop.describe(fit, sizes):
        print(line, flush=True)
    path = out / "loss_vs_compute.png"
    drawn = isoflop.plot(fit, str(path))
    print(f"plot: {path}" if drawn else f"no plot (matplotlib is not installed): --plot {out / 'isoflop.json'}")


def _train_all(jobs: list, shard_dict: dict, workers: int, work: Path):
    """(trial, its row) as each trial finishes: in this process, or (workers > 1) in that many processes at once,
    the trials with the most steps first."""
    if workers <= 1:
        for t, data in jobs:
            yield t, _trial(t, data, shard_dict, work)
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = sorted(jobs, key=lambda j: -j[1]["train"]["max_steps"])
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(_trial, t, data, shard_dict, work): t for t, data in jobs}
        for f in cf.as_completed(futures):
            yield futures[f], f.result()


def _trial(t, data: dict, shard_dict: dict, work: Path) -> dict:
    """One trial trained to its last step: its row (parameters, tokens, FLOPs, steps, val loss, seconds)."""
    import torch

    from lmyard.data.shardset import ShardSet
    from lmyard.sweep.record import compute

    torch.set_num_threads(1)
    shards = ShardSet.from_dict(shard_dict)
    cfg = _config(data)
    steps = cfg.train.max_steps
    n, d, flops = compute(cfg.model_dump(mode="json"), shards.n_vocab, steps)
    t0 = time.perf_counter()
    loss = _train(cfg, shards)
    shutil.rmtree(work / "store" / "runs" / cfg.run_name, ignore_errors=True)
    return {"trial": t.name, "size": t.size, "budget": t.budget, "params": n, "tokens": d, "flops": flops,
            "steps": steps, "val_loss": loss, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def _train(cfg, shards) -> float:
    """lmyard's Trainer in this process, no lineage (as bench_parity.lmyard_run); the last step's val loss."""
    from bench_parity import Recorder

    from lmyard.run import Run
    from lmyard.stages import TrainSpec
    from lmyard.train.distributed import setup_distributed
    from lmyard.train.trainer import Trainer

    sink = Recorder()
    with contextlib.redirect_stdout(sys.stderr):
        Trainer(TrainSpec(config=cfg, shards=shards), Run.of(cfg), setup_distributed(cfg), sink).train()
    return sink.points["loss/val"][cfg.train.max_steps]


def _config(data: dict):
    from lmyard.config import RunConfig

    return RunConfig.model_validate(data)


if __name__ == "__main__":
    main()
