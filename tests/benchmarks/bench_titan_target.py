"""Time to a target loss: lmyard's trainer against torchtitan 0.2.2's, Llama 1B, on the same batches of real text.

On one H200 (Python 3.12, torch 2.11, numpy, tiktoken, transformers; no network), from the repository root,
about 5-6 minutes (per side: ~72 s of 500 steps at ~57k tokens/s, plus start-up and compile, ~1 min; the
corpus and its shards, ~20 s):

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/bench-py312/*.whl
    export PYTHONPATH=$PWD && . .whl/titan/INSTALL.sh    # torchtitan 0.2.2 and its needs: /tmp/site first
    TIKTOKEN_CACHE_DIR=$PWD/.whl/bench-py312/tiktoken timeout 560 python3 tests/benchmarks/bench_titan_target.py \
        --gpus 1 --steps 500 --json $OUT/titan_target.json --titan-log $OUT/titan_target.log

    # 4 GPUs: --gpus 4 (4 x 2,048 tokens a rank, 32,768 a step; FSDP2 on both sides); more seeds: --seeds 0,1
    # a CPU dry run (torchtitan on PYTHONPATH): --device cpu --preset llama-tiny --steps 8 --batch 2 --window 3 \
    #     --warmup 2 --compile-steps 2

The data: the Python installation's .py files (bench_pylib.write_corpus, enough MB for the run unless
`--corpus-mb`), sharded by lmyard's tokenize-and-shard stage with GPT-2's BPE (ids < 50,257, within Llama's
vocabulary) with data.shuffle_documents, read by lmyard with data.shuffle_sequences (seeded by train.seed), as
the llama-1b recipe does (bench_parity.prepare: corpus, shards; bench_parity.settings: the run's settings).

What is equal: the token ids of every step, on every rank. lmyard's train loader (lmyard.data.loader.TrainBatches,
made by lmyard.train.build.data as the trainer makes it) lists the global sequences of the whole run in its
order (sequence k: T + 1 tokens from position P(k) * T of the train split, P its seeded permutation); they are
written, in that order, into one token file that torchtitan's data loader reads (run_torchtitan.ShardLoader: rank
r, step s reads rows (s * world + r) * batch ... + batch), and lmyard's rank r at step s reads global sequences
s * world * batch + r * batch ... + batch: the same rows. Each side's loader checksums (CRC-32) the int64 rows
each rank reads, of step 0 and of all steps (run_torchtitan.BatchCrc); the script prints both and stops where
they differ. Each step is one micro-batch a rank (`--batch` sequences of 2,048 tokens) and the logged loss is
the mean token loss over all ranks, on both sides. The schedule: linear warmup over `--warmup` steps to `--lr`,
cosine to lr * min_lr_ratio at the last step (lmyard's train.lr_at; torchtitan's --lr_scheduler.warmup_steps,
decay_type cosine, min_lr_factor, no decay_ratio: the same lr at every step). AdamW betas 0.9 / 0.95, eps 1e-8,
weight decay 0.1, gradient clipping at 1.0, bf16 autocast on one GPU (lmyard's ddp path, torchtitan without
FSDP), FSDP2 with bf16 parameters and fp32 reduction on more, torch.compile on both (torchtitan: model and
loss). What differs: the initial weights (each side's own initialisation, each seeded by `--seeds`), torchtitan's
weight decay on the norm gains too (lmyard: matrices only), its RoPE with Llama 3's frequency scaling, and each
side's kernels. Checkpoints and validation are off on both sides (lmyard's Checkpointing.due and Validator.due
answer False in this benchmark's process; lmyard still makes its checkpoint copy buffers after the first step,
in the background, as in any run). On the CPU with more than one rank torchtitan's initial weights are
not those it makes on GPUs (DTensor's random ops are correct on CUDA-like devices only; its loss then starts
below ln(vocab) on repetitive text): there the dry run checks the plumbing, not the losses.

The measure: each side's train loss at every step (lmyard: its metrics sink, kept in memory by the train stage's
rank 0, bench_parity.Recorder; torchtitan: --metrics.log_freq 1 step lines) and its wall-clock seconds from the
first step's start to the end of that step (lmyard: time.perf_counter at Trainer.step's first call and at each
step's log, after a device synchronize; torchtitan: its log lines' timestamps, from "Training starts" to each
step line, logged after the loss's .item()). Compile in: those seconds. Compile out: the first
`--compile-steps` steps counted at the median step time of the rest. Both read the same batch at each step, so
the moving mean of the train loss over `--window` steps is compared: for each target (`--targets`, default the
highest final moving mean of any run rounded up to 0.05, and 0.2, 0.5 and 1.0 above it: levels every run of both
sides reaches) the seconds and GPU-hours to the first step at or below it, mean over seeds, and torchtitan /
lmyard. Prints a markdown table and a `summary {...}` JSON line; `--json` writes per-step [step, seconds, loss]
of both sides per seed, with the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

SIDES = ("lmyard", "torchtitan")
CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}  # each side's own: compile_caches
TITAN_TIME = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+)")


# ---------------------------------------------------------------- lmyard's side: one rank, under torchrun


def lmyard_worker(spec: str, out: str, crc_dir: str) -> None:
    """One rank of the train stage (lmyard.train.stage.train_stage, unchanged) with, in this process only: rank 0's
    metrics kept in memory (bench_parity.Recorder instead of MLflow), the time the first step starts, each rank's
    batch checksums (TrainBatches.micro_batch wrapped), checkpoints and validation off. Rank 0 writes `out`."""
    import time

    import torch
    from bench_parity import Recorder
    from run_torchtitan import BatchCrc

    from lmyard.data.loader import TrainBatches
    from lmyard.tracking.sink import NullSink
    from lmyard.train import components, stage, trainer

    rank, sink, started = int(os.environ.get("RANK", 0)), Recorder(), {}
    steps = json.loads(Path(spec).read_text())["config"]["train"]["max_steps"]
    stage.metrics_sink = lambda lineage, is_main: sink if is_main else NullSink()
    components.Checkpointing.due = components.Validator.due = lambda self, step: False
    crc, micro_batch, step = BatchCrc(crc_dir, "lmyard", rank, steps), TrainBatches.micro_batch, trainer.Trainer.step

    def checked(self, cursor: int, micro: int):
        x, y = micro_batch(self, cursor, micro)
        crc.add(cursor // self.per_step, torch.cat([x, y[:, -1:]], dim=1).numpy())
        return x, y

    def timed(self):
        started.setdefault("first_step", time.perf_counter())
        return step(self)

    TrainBatches.micro_batch, trainer.Trainer.step = checked, timed
    way = os.environ.get("BENCH_PINNED")  # bench_first_steps.py: how the checkpoint copy buffers are made
    if way == "none":
        from lmyard.checkpoint import manager

        manager.CheckpointManager.prepare = lambda self: None
    elif way == "torch":
        from lmyard.checkpoint import dcp, full

        full.pinned_empty = dcp.pinned_empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True)
    code = stage.train_stage(spec)
    if code:
        sys.exit(code)
    if rank == 0:
        points = {"start": started["first_step"], "at": sink.at["loss/train"], "loss": sink.points["loss/train"]}
        Path(out).write_text(json.dumps(points))


def lmyard_side(cfg, shards: dict, gpus: int, work: Path, crc_dir: Path) -> list[list[float]]:
    """lmyard's run on `gpus` ranks (torchrun, lmyard_worker); [step, seconds, loss] per step. Its output goes
    to stderr."""
    spec, out = work / f"spec-{cfg.train.seed}.json", work / f"lmyard-{cfg.train.seed}.json"
    spec.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "shards": shards, "lineage": None}))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    cmd = [*torchrun, str(Path(__file__).resolve()), "--lmyard-worker", str(spec), str(out), str(crc_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"lmyard's run failed with exit code {proc.returncode} (its output is above)")
    points = json.loads(out.read_text())
    at, loss = points["at"], points["loss"]
    return [[int(s), at[s] - points["start"], loss[s]] for s in sorted(loss, key=int)]


# ---------------------------------------------------------------- torchtitan's side


def titan_shard(cfg, shards, T: int, gpus: int, path: Path) -> Path:
    """The rows lmyard's loader reads over the whole run (lmyard.train.build.data, as the trainer makes it), in
    its global order, as one token file for run_torchtitan's ShardLoader."""
    from lmyard.data.shards import VERSION_U16, write_shard
    from lmyard.paths import cache_root
    from lmyard.train import build

    accum, batches, _ = build.data(cfg, shards, T, 0, gpus, cache_root())
    if accum != 1:
        raise SystemExit(f"one micro-batch a step on each side (lmyard would take {accum})")
    rows = batches.sequences(0, cfg.train.max_steps * batches.per_step)
    write_shard(path, rows.reshape(-1), VERSION_U16)
    return path


def titan_side(a: argparse.Namespace, cfg, shard: Path, T: int, crc_dir: Path) -> list[list[float]]:
    """torchtitan's own trainer (run_torchtitan.launch) on `shard` with lmyard's schedule and AdamW settings;
    [step, seconds, loss] per step from its log lines' timestamps."""
    import run_torchtitan

    t = cfg.train
    run = argparse.Namespace(preset=a.preset, seq=T, batch=a.batch, steps=t.max_steps, log_freq=1, ac="none",
                             compile=a.device == "cuda", float8="none", attn="sdpa", device=a.device, log=a.titan_log)  # fmt: skip
    options = {
        "--optimizer.lr": t.lr,
        "--optimizer.beta1": t.beta1,
        "--optimizer.beta2": t.beta2,
        "--optimizer.eps": "1e-8",
        "--optimizer.weight_decay": t.weight_decay,
        "--lr_scheduler.warmup_steps": t.warmup_steps,
        "--lr_scheduler.decay_type": "cosine",
        "--lr_scheduler.min_lr_factor": t.min_lr_ratio,
        "--training.max_norm": t.grad_clip,
        "--debug.seed": t.seed,
    }
    out = run_torchtitan.launch(run, a.gpus, shard, options, {"crc_dir": str(crc_dir)})
    return titan_points(run_torchtitan.ANSI.sub("", out))


def titan_points(out: str) -> list[list[float]]:
    """[step, seconds since "Training starts", loss] from torchtitan's rank-0 log lines (their timestamps)."""
    start, points = None, {}
    for line in out.splitlines():
        stamp = TITAN_TIME.search(line)
        if not stamp:
            continue
        at = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if "Training starts at step" in line:
            start = at
        elif (m := TITAN_STEP.search(line)) and start is not None:
            points.setdefault(int(m.group(1)), [int(m.group(1)), at - start, float(m.group(2))])
    if not points:
        raise SystemExit("no torchtitan step line after its 'Training starts' line")
    return [points[s] for s in sorted(points)]


def check_batches(crc_dir: Path, gpus: int) -> dict:
    """Both sides' batch checksums per rank; SystemExit where they differ or one is missing."""
    found = {s: [json.loads((crc_dir / f"{s}-rank{r}.json").read_text()) for r in range(gpus)
                 if (crc_dir / f"{s}-rank{r}.json").exists()] for s in SIDES}  # fmt: skip
    report = {s: [(c["step0"], c["all_steps"]) for c in found[s]] for s in SIDES}
    print(json.dumps({"batch_crc32_per_rank_step0_all_steps": report}), file=sys.stderr, flush=True)
    if len(found["lmyard"]) != gpus or report["lmyard"] != report["torchtitan"]:
        raise SystemExit(f"the two sides' batches differ: {report}")
    return {"equal": True, "step0_crc32": [c for c, _ in report["lmyard"]], "all_steps_crc32": [c for _, c in report["lmyard"]]}  # fmt: skip


# ---------------------------------------------------------------- the measure


def moving_mean(loss: np.ndarray, window: int) -> np.ndarray:
    """The mean of the last `window` losses at each step (NaN before the first full window)."""
    out, window = np.full(len(loss), np.nan), min(window, len(loss))
    sums = np.cumsum(np.insert(loss, 0, 0.0))
    out[window - 1 :] = (sums[window:] - sums[:-window]) / window
    return out


def compile_out(seconds: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """Seconds with the first `k` steps counted at the median step time of the rest; (seconds, that step time)."""
    k = max(1, min(k, len(seconds) - 2))
    steady = float(np.median(np.diff(seconds[k - 1 :])))
    return np.where(np.arange(len(seconds)) < k, steady * np.arange(1, len(seconds) + 1),
                    seconds - seconds[k - 1] + k * steady), steady  # fmt: skip


def curves(run: list[list[float]], a: argparse.Namespace) -> dict:
    s = np.asarray(run, dtype=np.float64)
    out, steady = compile_out(s[:, 1], a.compile_steps)
    return {"steps": s[:, 0].astype(int), "in": s[:, 1], "out": out, "mean": moving_mean(s[:, 2], a.window),
            "step_s": steady}  # fmt: skip


def reach(c: dict, target: float) -> dict | None:
    """The first step whose moving mean is at or below `target`: its step and seconds (compile in, out)."""
    hit = np.flatnonzero(c["mean"] <= target)
    if not hit.size:
        return None
    i = int(hit[0])
    return {"step": int(c["steps"][i]), "s_in": float(c["in"][i]), "s_out": float(c["out"][i])}


def summarize(runs: list[dict], a: argparse.Namespace, tokens_per_step: int) -> dict:
    """Per target: each side's mean seconds (compile in, out), GPU-hours, step, and torchtitan / lmyard."""
    per = [{side: curves(r[side], a) for side in SIDES} for r in runs]
    finals = {side: [float(p[side]["mean"][-1]) for p in per] for side in SIDES}
    top = max(max(v) for v in finals.values())
    targets = a.targets or [round(math.ceil(top / 0.05 - 1e-9) * 0.05 + d, 2) for d in (1.0, 0.5, 0.2, 0.0)]
    rows = []
    for target in sorted(targets, reverse=True):
        hits = {side: [reach(p[side], target) for p in per] for side in SIDES}
        if any(h is None for side in SIDES for h in hits[side]):
            rows.append({"target": target, "reached_by_all": False})
            continue
        row = {"target": target, "reached_by_all": True}
        for side in SIDES:
            for k in ("s_in", "s_out", "step"):
                row[f"{side}_{k}"] = float(np.mean([h[k] for h in hits[side]]))
            row[f"{side}_gpu_h"] = row[f"{side}_s_in"] * a.gpus / 3600
            row[f"{side}_gpu_h_out"] = row[f"{side}_s_out"] * a.gpus / 3600
            row[f"{side}_s_in_per_seed"] = [h["s_in"] for h in hits[side]]
        row.update({f"titan_over_lmyard_{k}": row[f"torchtitan_{k}"] / row[f"lmyard_{k}"] for k in ("s_in", "s_out")})
        rows.append(row)
    steady = {side: float(np.mean([p[side]["step_s"] for p in per])) for side in SIDES}
    return {"preset": a.preset, "gpus": a.gpus, "steps": a.steps, "seeds": a.seeds, "window": a.window,
            "compile_steps": a.compile_steps, "tokens_per_step": tokens_per_step, "targets": rows,
            "final_moving_mean": finals, "step_ms": {s: v * 1e3 for s, v in steady.items()},
            "tokens_per_s": {s: tokens_per_step / v for s, v in steady.items()}}  # fmt: skip


def table(summary: dict) -> str:
    head = (f"| target (train loss, {summary['window']}-step mean) | lmyard s: compile in / out | torchtitan s: in / out "
            "| torchtitan / lmyard: in / out | GPU-h lmyard / torchtitan: in (out) | step lmyard / torchtitan |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    lines = [head]
    for r in summary["targets"]:
        if not r["reached_by_all"]:
            lines.append(f"| {r['target']:.2f} | not reached by every run | | | | |")
            continue
        lines.append(f"| {r['target']:.2f} | {r['lmyard_s_in']:.1f} / {r['lmyard_s_out']:.1f} "
                     f"| {r['torchtitan_s_in']:.1f} / {r['torchtitan_s_out']:.1f} "
                     f"| {r['titan_over_lmyard_s_in']:.3f}x / {r['titan_over_lmyard_s_out']:.3f}x "
                     f"| {r['lmyard_gpu_h']:.4f} ({r['lmyard_gpu_h_out']:.4f}) / {r['torchtitan_gpu_h']:.4f} "
                     f"({r['torchtitan_gpu_h_out']:.4f}) "
                     f"| {r['lmyard_step']:.0f} / {r['torchtitan_step']:.0f} |")  # fmt: skip
    f, ms = summary["final_moving_mean"], summary["step_ms"]
    lines.append(f"| final moving mean (mean of seeds) | {np.mean(f['lmyard']):.4f} | {np.mean(f['torchtitan']):.4f} "
                 f"| step ms lmyard / torchtitan: {ms['lmyard']:.1f} / {ms['torchtitan']:.1f} | | |")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------- the run


@contextlib.contextmanager
def compile_caches(a: argparse.Namespace, folder: Path):
    """Each side compiles into its own new, empty inductor and Triton caches (both default to one folder of the
    machine, where the side that ran second would find the first's kernels), unless --shared-caches."""
    if a.shared_caches:
        yield
        return
    saved = {k: os.environ.get(k) for k in CACHE_VARS}
    os.environ.update({k: str(folder / name) for k, name in CACHE_VARS.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def one_seed(a: argparse.Namespace, work: Path, corpus: Path, shards, T: int, seed: int) -> dict:
    """Both sides from their own seeded initial weights on the same batches; their per-step points."""
    from bench_parity import settings

    from lmyard.recipes import load_recipe

    cfg = load_recipe("smoke", [*settings(a, work, corpus), f"train.seed={seed}", f"run_name=titan-target-{seed}"])
    crc_dir = work / f"crc-{seed}"
    crc_dir.mkdir(parents=True, exist_ok=True)
    shard = titan_shard(cfg, shards, T, a.gpus, work / f"titan-rows-{seed}.bin")
    with compile_caches(a, work / f"caches-{seed}" / "lmyard"):
        run = {"seed": seed, "lmyard": lmyard_side(cfg, shards.to_dict(), a.gpus, work, crc_dir)}
    with compile_caches(a, work / f"caches-{seed}" / "torchtitan"):
        run["torchtitan"] = titan_side(a, cfg, shard, T, crc_dir)
    run["batches"] = check_batches(crc_dir, a.gpus)
    for side in SIDES:
        last = run[side][-1]
        print(json.dumps({"seed": seed, "side": side, "steps": len(run[side]), "last_step": last[0],
                          "seconds": round(last[1], 1), "loss": last[2]}), file=sys.stderr, flush=True)  # fmt: skip
    return run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b", help="llama-1b (seq 2048); llama-tiny (seq 64) on the CPU")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=1, help="GPUs (ranks, with --device cpu); --batch sequences each")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=4, help="sequences a rank a step (one micro-batch)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's floor, a fraction of --lr")
    p.add_argument("--parallel", choices=["auto", "ddp", "fsdp"], default="auto",
                   help="lmyard's train.parallel; auto: ddp on one GPU (torchtitan: no FSDP), else fsdp")  # fmt: skip
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0], help="e.g. 0,1")
    p.add_argument("--window", type=int, default=20, help="steps of the train loss's moving mean")
    p.add_argument("--targets", type=float, nargs="*", default=None, help="moving-mean losses to time")
    p.add_argument("--compile-steps", type=int, default=3, help="first steps replaced by the steady step time")
    p.add_argument("--corpus-mb", type=float, default=None, help="MB of .py files; default: enough for the run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="lmyard's")
    p.add_argument("--json", default=None, help="write the per-step points and the summary here")
    p.add_argument("--titan-log", default=None, help="append torchtitan's whole output to this file")
    p.add_argument("--tmp", default=None, help="work folder (default: a new temporary one, removed)")
    p.add_argument(
        "--shared-caches",
        action="store_true",
        help="both sides use the machine's inductor and Triton caches (default: each its own, empty)",
    )
    return p


def main() -> None:
    if "--lmyard-worker" in sys.argv:
        return lmyard_worker(*sys.argv[sys.argv.index("--lmyard-worker") + 1 :][:3])
    from bench_parity import prepare

    a = parser().parse_args()
    T = 64 if a.preset == "llama-tiny" else 2048
    tokens_per_step = a.batch * T * a.gpus
    parallel = a.parallel if a.parallel != "auto" else ("ddp" if a.gpus == 1 else "fsdp")
    # bench_parity.settings' names: one micro-batch of --batch a rank, batch_tokens over the ranks (its `accum`)
    a.micro_batch, a.accum = a.batch, a.gpus
    a.corpus_mb = a.corpus_mb or max(2.0, round(a.steps * tokens_per_step / 0.3e6 + 1, 1))  # ~0.4M tokens a MB
    a.overrides = [f"train.warmup_steps={a.warmup}", f"train.min_lr_ratio={a.min_lr_ratio}", f"train.parallel={parallel}",
                   f"launch.nproc_per_node={a.gpus}", "data.shuffle_documents=true", "data.shuffle_sequences=true",
                   *a.overrides]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="titan-target-") as tmp:
        work = Path(a.tmp or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus, _, shards, _, _, _, _ = prepare(a, work)
        runs = [one_seed(a, work, corpus, shards, T, seed) for seed in a.seeds]
    summary = summarize(runs, a, tokens_per_step)
    summary["batches"] = [{"seed": r["seed"], **r["batches"]} for r in runs]
    for same in summary["batches"]:  # each rank's CRC-32 of its rows, the same on both sides (else SystemExit above)
        print("batches " + json.dumps(same))
    print(table(summary))
    print("summary " + json.dumps(summary), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": runs}))


if __name__ == "__main__":
    main()
