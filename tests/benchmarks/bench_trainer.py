"""Trainer throughput against the bare nanoGPT-style reference loop, same GPUs, same run.

    python tests/benchmarks/bench_trainer.py --ref path/to/gpt2_ref_bench.py --gpus 1 2

For each GPU count N it runs the reference (`gpt2_ref_bench.py`, random tokens,
B=32, T=1024, torch.compile, bf16, fused AdamW) and then lmyard's own trainer
(`torchrun -m lmyard.dispatch train`) on GPT-2 124M with the same micro-batch, reading
memory-mapped shards of random tokens through its real data path (background
prefetch, pinned memory), with logging, the divergence check every 10 steps and
one checkpoint at the end. Prints one JSON line per run and a summary: tokens/s,
per GPU, MFU (6N + 12*L*d*T FLOPs per token against 989 TFLOP/s dense bf16 on
H100/H200), the ratio to the reference, DDP scaling efficiency against 1 GPU,
and the share of step time spent waiting for data. With `--accum-tokens` the
tokens per optimizer step stay fixed across GPU counts (gradient accumulation,
one all-reduce per step), as in a real run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from random_shards import make_shards  # noqa: E402

from lmyard.recipes import load_recipe  # noqa: E402

STEP_LINE = re.compile(
    r"step (\d+)/\d+ \| .* \| ([\d,]+) tok/s \| ([\d.]+) ms/step \| data wait ([\d.]+)%(?: \| mfu ([\d.]+)%)?"
)


def run_reference(ref: str, gpus: int, batch: int, steps: int) -> dict:
    env = {**os.environ, "B": str(batch), "STEPS": str(steps)}
    cmd = (
        [sys.executable, ref]
        if gpus == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", ref]
    )
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def run_lmyard(
    store: Path,
    shards: dict,
    gpus: int,
    batch: int,
    steps: int,
    overrides: list[str],
    extra_env: dict[str, str],
    accum: int = 1,
    log_interval: int = 10,
    warmup_logs: int = 2,
) -> dict:
    cfg = load_recipe(
        "smoke",
        [
            f"store={store}",
            f"run_name=bench-{gpus}gpu",
            "model.preset=gpt2-124m",
            f"train.max_steps={steps}",
            f"train.micro_batch={batch}",
            f"train.batch_tokens={batch * 1024 * gpus * accum}",
            f"train.log_interval={log_interval}",
            "train.warmup_steps=10",
            "train.lr=6e-4",
            "eval.interval=100000",
            "eval.val_tokens=65536",
            "checkpoint.interval=100000",
            "train.device=cuda",
            f"launch.nproc_per_node={gpus}",
            *overrides,
        ],
    )
    shutil.rmtree(store / "runs" / f"bench-{gpus}gpu", ignore_errors=True)  # else the run resumes the last one
    spec = store / f"spec-{gpus}.json"
    spec.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "shards": shards, "lineage": None}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        "-m",
        "lmyard.dispatch",
        "train",
        "--spec",
        str(spec),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "LMYARD_CACHE": str(store / "cache"),
        **extra_env,
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(proc.stdout[-4000:] + proc.stderr[-4000:])
    logs = [m.groups() for m in map(STEP_LINE.search, proc.stdout.splitlines()) if m]
    timed = logs[warmup_logs:-1]  # skip compile/warm-up intervals and the last (it includes the final eval)
    tok_s = statistics.median(float(t[1].replace(",", "")) for t in timed)
    return {
        "world": gpus,
        "B": batch,
        "accum": accum,
        "tok_s": round(tok_s),
        "tok_s_per_gpu": round(tok_s / gpus),
        "step_ms": statistics.median(float(t[2]) for t in timed),
        "data_wait_pct": round(max(float(t[3]) for t in timed), 3),
        "mfu": statistics.median(float(t[4]) for t in timed) / 100 if timed[0][4] else None,
        "intervals": len(timed),
        "all_gather": next(
            (ln.split()[2] for ln in proc.stdout.splitlines() if ln.startswith("fsdp all-gather:")), None
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", help="path of gpt2_ref_bench.py (required unless --no-ref)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=80, help="lmyard steps (logged every 10)")
    ap.add_argument("--ref-steps", type=int, default=30)
    ap.add_argument(
        "--accum-tokens",
        type=int,
        default=None,
        help="lmyard only: tokens per optimizer step for every GPU count (e.g. 524288, GPT-2's "
        "batch), reached by gradient accumulation, so DDP all-reduces once per that many tokens",
    )
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="config override for lmyard's runs, e.g. model.attention=cudnn (repeatable)",
    )
    ap.add_argument("--env", action="append", default=[], help="K=V set for lmyard's runs only (repeatable)")
    ap.add_argument("--no-ref", action="store_true", help="skip the reference runs")
    args = ap.parse_args()
    if not args.ref and not args.no_ref:
        ap.error("give --ref path/to/gpt2_ref_bench.py, or --no-ref to time lmyard alone")
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    import torch

    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory(prefix="lmyard-bench-") as tmp:
        store = Path(tmp)
        shards = make_shards(store, 64 * 1024 * 1024)
        for gpus in args.gpus:
            ref = {"tok_s": float("nan")} if args.no_ref else run_reference(args.ref, gpus, args.batch, args.ref_steps)
            print(json.dumps({"kind": "reference", **ref}), flush=True)
            accum = 1
            if args.accum_tokens:
                accum, rest = divmod(args.accum_tokens, args.batch * 1024 * gpus)
                if rest or not accum:
                    raise SystemExit(
                        f"--accum-tokens {args.accum_tokens} is not a multiple of --batch * 1024 * {gpus} GPUs"
                    )
            ours = run_lmyard(
                store, shards, gpus, args.batch, args.steps, args.overrides, extra_env, accum, args.log_interval
            )
            ours["overrides"], ours["env"] = args.overrides, extra_env
            ours["vs_reference"] = round(ours["tok_s"] / ref["tok_s"], 3)
            print(json.dumps({"kind": "lmyard", **ours}), flush=True)
            results["runs"].append({"reference": ref, "lmyard": ours})
    base = {r["lmyard"]["world"]: r for r in results["runs"]}
    if 1 in base:
        for r in results["runs"]:
            w = r["lmyard"]["world"]
            r["lmyard"]["scaling_eff"] = round(r["lmyard"]["tok_s"] / (w * base[1]["lmyard"]["tok_s"]), 3)
            r["reference"]["scaling_eff"] = round(r["reference"]["tok_s"] / (w * base[1]["reference"]["tok_s"]), 3)
    print("summary " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
