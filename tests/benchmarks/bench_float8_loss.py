"""float8 against bf16 over a few hundred steps of real text: is the loss curve within the noise of bf16?

    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_float8_loss.py                     # 4 GPUs, one run each
    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_float8_loss.py --steps 300 --preset llama-1b

Writes the Python installation's source files as a corpus and shards it (bench_pylib.py: GPT-2 BPE, both
shuffles on), then trains the same model four times through `torchrun -m lmyard.dispatch train`, each run on a GPU of
its own, --gpus of them at a time:

- `bf16`: train.float8 off, train.seed 1337;
- `bf16-seed2`: the same with train.seed 1338 (another initialisation and sequence order): the noise;
- `float8-rowwise` and `float8-tensorwise`: train.float8 with that recipe, train.seed 1337.

Prints one JSON report: each run's validation losses (every --eval-every steps) and its train loss averaged
over windows of --window steps, and per float8 run the largest gap to `bf16` against the largest gap between
the two bf16 seeds, on both curves. `within_noise`: the float8 run's largest validation gap is no larger than
the seeds' largest. A float8 run whose trainer skipped float8 (no torchao, no float8 matmuls) stops the
script with the trainer's reason. Needs GPUs with float8 matmuls (compute capability 8.9+) and torchao.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pylib import REPO, corpus_shards, train, write_corpus

sys.path.insert(0, str(REPO))
from lmyard.recipes import load_recipe

RUNS = {
    "bf16": {"train.float8": "false", "train.seed": 1337},
    "bf16-seed2": {"train.float8": "false", "train.seed": 1338},
    "float8-rowwise": {"train.float8": "true", "train.float8_recipe": "rowwise", "train.seed": 1337},
    "float8-tensorwise": {"train.float8": "true", "train.float8_recipe": "tensorwise", "train.seed": 1337},
}


def config(a: argparse.Namespace, work: Path, corpus: Path, run: str):
    micro = a.seq * a.micro_batch
    return load_recipe(
        "smoke",
        [
            f"store={work / 'store'}",
            f"run_name=float8-{run}",
            f"data.source={corpus}",
            "tokenizer.name=gpt2",
            f"model.preset={a.preset}",
            f"model.block_size={a.seq}",
            "data.val_every=50",
            "data.shuffle_documents=true",
            "data.shuffle_sequences=true",
            f"train.device={a.device}",
            "train.parallel=fsdp",
            f"train.max_steps={a.steps}",
            f"train.micro_batch={a.micro_batch}",
            f"train.batch_tokens={micro * a.accum}",
            f"train.lr={a.lr}",
            f"train.warmup_steps={a.steps // 10}",
            "train.log_interval=1",
            f"eval.interval={a.eval_every}",
            "eval.val_tokens=262144",
            "checkpoint.interval=100000",
            "launch.nproc_per_node=1",
            *(f"{k}={v}" for k, v in RUNS[run].items()),
        ],
    )


def windows(points: list[tuple[int, float]], size: int) -> dict[int, float]:
    """The mean train loss of each window of `size` steps, keyed by its last step."""
    out: dict[int, list[float]] = {}
    for step, loss in points:
        out.setdefault((step - 1) // size * size + size, []).append(loss)
    return {end: round(statistics.fmean(v), 4) for end, v in sorted(out.items()) if len(v) == size}


def largest_gap(a: dict, b: dict) -> float:
    return round(max(abs(a[k] - b[k]) for k in a.keys() & b.keys()), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--window", type=int, default=25, help="steps per train-loss average")
    p.add_argument("--gpus", type=int, default=4, help="GPUs: that many runs at a time, one per GPU")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--corpus-mb", type=float, default=None, help="only the first files, up to this size")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of the script")
    p.add_argument("--tmp", default=None, help="work folder (default: a new temporary one, kept)")
    a = p.parse_args()
    if "bf16" not in a.runs:
        p.error("--runs must include bf16: every other run is compared with it")
    work = Path(a.tmp or tempfile.mkdtemp(prefix="lmyard-float8-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "pylib.jsonl"
    report: dict = {"corpus": write_corpus(corpus, a.corpus_mb)}
    shards, report["shards"] = corpus_shards(config(a, work, corpus, "bf16"), work)

    free: queue.Queue[int] = queue.Queue()
    for gpu in range(a.gpus):
        free.put(gpu)

    def one(run: str) -> dict:
        folder = work / run
        folder.mkdir(exist_ok=True)
        gpu = free.get()  # a GPU of its own: runs wait for one
        try:
            cfg = config(a, work, corpus, run)
            losses = train(cfg, shards, folder, env={"CUDA_VISIBLE_DEVICES": str(gpu)}, prefix=f"[{run}] ")
        finally:
            free.put(gpu)
        skipped = [w for w in losses["warnings"] if w.startswith("train.float8 skipped")]
        if skipped and a.device == "cuda":  # a bf16 run under a float8 name would compare bf16 with itself
            raise SystemExit(f"{run}: {skipped[0]}")
        return {"val": dict(losses["val"]), "train": windows(losses["train"], a.window)}

    with ThreadPoolExecutor(len(a.runs)) as pool:
        curves = dict(zip(a.runs, pool.map(one, a.runs)))
    report["runs"] = curves
    base, seeds = curves["bf16"], curves.get("bf16-seed2")
    noise = {k: largest_gap(base[k], seeds[k]) for k in ("val", "train")} if seeds else None
    report["seed_gap"] = noise
    for run in (r for r in a.runs if r.startswith("float8")):
        gap = {k: largest_gap(base[k], curves[run][k]) for k in ("val", "train")}
        report[f"{run}_gap"] = gap
        if noise:
            report[f"{run}_within_noise"] = gap["val"] <= noise["val"]
    report["settings"] = vars(a) | {"tmp": str(work)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
