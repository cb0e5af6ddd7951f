"""Training tokens/s with checkpoint evaluation running beside it, versus without: same machine, same run.

    python tests/benchmarks/bench_eval_overhead.py                  # CPU: trainer on core 0, evaluator on core 1
    python tests/benchmarks/bench_eval_overhead.py --gpu            # GPT-2 124M on cuda:0, evaluator on cuda:1
                                                                    # (random-token shards; r50k_base for samples)
    python tests/benchmarks/bench_eval_overhead.py --set train.max_steps=600 --repeats 3

Each repeat trains the same run twice from scratch (a fresh run_name each time),
alternating the order: once alone, once while an evaluator thread watches the
store and, for every new checkpoint, runs `python -m lmyard.evaluate` (the process
the flow's evaluate-checkpoint task starts: val loss, HellaSwag when configured,
samples) on eval.device. Throughput is the trainer's own tokens/s (its log lines;
checkpoint saves and its val-loss passes are excluded from them), median over
the steps after warm-up. Prints one JSON line per run and the slowdown.

On a CPU host "its own device" is a core of its own (sched_setaffinity): the two
still share memory bandwidth and caches, and on a small shared machine other load
shows up in the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from random_shards import make_shards  # noqa: E402

from lmyard.checkpoint.catalog import complete_steps  # noqa: E402
from lmyard.data.shards import ShardSet  # noqa: E402
from lmyard.launch.local_job import run_local  # noqa: E402
from lmyard.recipes import load_recipe  # noqa: E402
from lmyard.run import Run  # noqa: E402
from lmyard.store import open_store  # noqa: E402

STEP_LINE = re.compile(r"^step (\d+)/\d+ \|.*\| ([\d,]+) tok/s")

CPU = {
    "train.max_steps": 300,
    "train.batch_tokens": 2048,
    "train.micro_batch": 8,
    "train.log_interval": 5,
    "train.threads_per_rank": 1,
    "train.device": "cpu",
    "model.n_layer": 4,
    "model.n_embd": 128,
    "model.n_head": 4,
    "model.block_size": 128,
    "launch.nproc_per_node": 1,
    "checkpoint.interval": 50,
    "eval.interval": 50,
    "eval.val_tokens": 16384,
    "eval.sample_tokens": 64,
    "eval.device": "cpu",
    "eval.threads": 1,
    "checkpoint.keep_last": 100,
}
# 16 seq * 1024 tokens * 4 micro-steps = 65,536 tokens/step on one GPU
GPU = {
    "train.max_steps": 400,
    "train.batch_tokens": 65536,
    "train.micro_batch": 16,
    "train.log_interval": 10,
    "train.device": "cuda",
    "model.preset": "gpt2-124m",
    "launch.nproc_per_node": 1,
    "checkpoint.interval": 50,
    "eval.interval": 50,
    "eval.device": "cuda:1",
    "checkpoint.keep_last": 100,
}


def measure(cfg, shards, with_eval: bool, warmup_steps: int, evaluator_cpus: set[int] | None) -> dict:
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    store = open_store(cfg.store)
    stop, evaluated, failed, eval_s = threading.Event(), [], [], []

    def evaluator() -> None:
        if evaluator_cpus:
            os.sched_setaffinity(0, evaluator_cpus)  # this thread; the processes it starts inherit it
        with tempfile.TemporaryDirectory() as tmp:
            spec_path, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
            with open(spec_path, "w") as f:
                json.dump({"config": spec["config"], "shards": spec["shards"]}, f)
            while not stop.is_set():
                for step in complete_steps(Run(cfg.run_name, store)):
                    if step not in evaluated and not stop.is_set():
                        t0 = time.perf_counter()
                        proc = subprocess.run(
                            [
                                sys.executable,
                                "-m",
                                "lmyard.evaluate",
                                "--spec",
                                spec_path,
                                "--step",
                                str(step),
                                "--out",
                                out,
                            ],
                            capture_output=True,
                            text=True,
                            cwd=REPO,
                        )
                        if proc.returncode:
                            print(
                                f"evaluation of step {step} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}",
                                file=sys.stderr,
                                flush=True,
                            )
                            failed.append(step)
                        else:
                            eval_s.append(time.perf_counter() - t0)
                            evaluated.append(step)
                stop.wait(1.0)

    thread = threading.Thread(target=evaluator, daemon=True)
    if with_eval:
        thread.start()
    rates: list[float] = []

    def on_line(line: str) -> None:
        m = STEP_LINE.match(line)
        if m and int(m.group(1)) > warmup_steps:
            rates.append(float(m.group(2).replace(",", "")))

    t0 = time.perf_counter()
    run_local(cfg, spec, on_line=on_line)
    wall = time.perf_counter() - t0
    if with_eval:
        time.sleep(1.0)  # let the evaluator pick up the last checkpoint, then stop it after that evaluation
        stop.set()
        thread.join()
    return {
        "with_eval": with_eval,
        "tokens_per_s": statistics.median(rates),
        "samples": len(rates),
        "wall_s": round(wall, 1),
        "evaluations": len(evaluated),
        "failed": failed,
        "eval_s_mean": round(statistics.mean(eval_s), 2) if eval_s else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="GPT-2 124M on cuda:0, evaluation on cuda:1")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmyard-bench-eval-"))
    os.environ.setdefault("LMYARD_CACHE", str(tmp / "cache"))
    values = {**(GPU if args.gpu else CPU), "store": str(tmp / "store")}
    base = [f"{k}={v}" for k, v in values.items()] + args.overrides
    if args.gpu:  # random GPT-2 token ids: the cost of evaluation does not depend on the text
        shards = ShardSet.from_dict(make_shards(tmp / "store", 64 * 1024 * 1024))
    else:
        from lmyard.data.sharding import tokenize_and_shard

        shards, _ = tokenize_and_shard(load_recipe("smoke", base), log=lambda s: None)
    cpus = sorted(os.sched_getaffinity(0))
    trainer_cpus = evaluator_cpus = None
    if not args.gpu and len(cpus) >= 2:
        trainer_cpus, evaluator_cpus = {cpus[0]}, {cpus[1]}
        os.sched_setaffinity(0, trainer_cpus)  # the trainer (started from this thread) inherits it
    results = []
    for r in range(args.repeats):
        for with_eval in (False, True) if r % 2 == 0 else (True, False):
            cfg = load_recipe("smoke", [*base, f"run_name=bench-{r}-{'eval' if with_eval else 'alone'}"])
            res = measure(cfg, shards, with_eval, args.warmup_steps, evaluator_cpus)
            res["repeat"] = r
            print(json.dumps(res), flush=True)
            results.append(res)
    alone = statistics.median(x["tokens_per_s"] for x in results if not x["with_eval"])
    beside = statistics.median(x["tokens_per_s"] for x in results if x["with_eval"])
    device = (
        "cuda:0 train / cuda:1 eval"
        if args.gpu
        else f"CPU core {cpus[0]} train / core {cpus[1] if len(cpus) > 1 else cpus[0]} eval"
    )
    print(
        json.dumps(
            {
                "summary": True,
                "device": device,
                "tokens_per_s_alone": alone,
                "tokens_per_s_with_eval": beside,
                "slowdown_pct": round(100 * (1 - beside / alone), 2),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
