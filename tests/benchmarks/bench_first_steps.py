"""The first steps of lmyard's train stage, each timed: what making the checkpoint copy buffers costs them.

    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_first_steps.py --steps 40
    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_first_steps.py --device cpu --preset llama-tiny \\
        --batch 2 --steps 4 --set train.compile=false            # a CPU dry run

After its first step the trainer makes the pinned host buffers its checkpoints are copied into, in a
background thread (CheckpointManager.prepare). This runs the train stage (bench_titan_target.py's lmyard
side: llama-1b, 4 x 2,048 tokens of the Python installation's .py files, checkpoints and validation off) once
per way the buffers are made, in this order, sharing one inductor cache: `none` (prepare skipped: the
baseline), `lmyard` (lmyard.checkpoint.pinned) and `torch` (`torch.empty(..., pin_memory=True)`). It prints
one JSON line per way: each step's seconds, and the seconds lost after step 1, the sum of steps 2.. over as
many of the baseline's median step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_titan_target as btt
from bench_parity import prepare, settings

from lmyard.recipes import load_recipe


def main() -> None:
    p = btt.parser()
    p.add_argument("--ways", default="none,lmyard,torch")
    a = p.parse_args()
    a.micro_batch, a.accum = a.batch, 1
    a.corpus_mb = a.corpus_mb or (8.0 if a.device == "cuda" else 1.0)
    a.overrides = [f"train.warmup_steps={a.warmup}", "train.parallel=ddp", "launch.nproc_per_node=1", *a.overrides]
    base = None
    with tempfile.TemporaryDirectory(prefix="first-steps-") as tmp:
        work = Path(tmp)
        corpus, _, shards, _, _, _, _ = prepare(a, work)
        cfg = load_recipe("smoke", [*settings(a, work, corpus), "train.seed=0", "run_name=first-steps"])
        for way in a.ways.split(","):
            os.environ["BENCH_PINNED"] = way
            crc = work / f"crc-{way}"
            crc.mkdir()
            ends = [t for _, t, _ in btt.lmyard_side(cfg, shards.to_dict(), 1, work, crc)]
            steps = [round(t - s, 3) for s, t in zip([0.0, *ends], ends)]
            base = base or statistics.median(steps[1:])
            lost = sum(steps[1:]) - (len(steps) - 1) * base
            print(json.dumps({"way": way, "lost_after_step_1_s": round(lost, 2), "steps_s": steps}), flush=True)


if __name__ == "__main__":
    main()
