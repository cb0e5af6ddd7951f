"""Where a DDP training step's time goes on the GPU: compute, exposed all-reduce, idle.

    torchrun --standalone --nproc_per_node=2 tests/benchmarks/profile_ddp_step.py [--set train.ddp_bucket_mb=100]

Builds lmyard's model and step exactly as the trainer does (DDP, then torch.compile,
bf16 autocast, fused AdamW, `train_step`), on random tokens already on the GPU, warms
up, then records a few steps with torch.profiler on rank 0 and splits each step's
wall time into: time some compute kernel runs, collective time (NCCL's kernels and
its copy-engine transfers) not hidden under compute, and time the GPU runs nothing
(launch gaps, host work, waits); and the kernel time of each kind (matmul, attention, inductor's fused elementwise
kernels, optimizer, collectives), and the longest stretches with no compute kernel
running (where in the profile, how long, how much a collective fills, the kernels
on either side). Prints one JSON line and the top kernels;
`--trace DIR` also writes the Chrome trace. Runs on one GPU too (no DDP):
`torchrun --standalone --nproc_per_node=1 ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lmyard.models.gpt2.model import GPT
from lmyard.models.registry import model_config
from lmyard.recipes import load_recipe
from lmyard.train.distributed import setup_distributed
from lmyard.train.distributed.parallelism import prepare_model
from lmyard.train.optim import AdamW
from lmyard.train.trainer import StepParts, train_step


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of `intervals` (already a union) that lies under `cover` (a union)."""
    total, j = 0.0, 0
    for s, e in intervals:
        while j < len(cover) and cover[j][1] <= s:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < e:
            total += min(e, cover[k][1]) - max(s, cover[k][0])
            k += 1
    return total


KINDS = (
    ("collectives", ("nccl", "memcpy ptop")),  # NCCL's kernels; its copy-engine transfers between GPUs
    ("loss", ("ce_grad",)),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")),
    ("copies", ("copyfunctor", "split_with_sizes", "chunk_cat")),  # FSDP2's copies in and out of its buffers
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("fused elementwise", ("triton",)),
)


def is_collective(kernel: str) -> bool:
    """NCCL's kernels, and the peer-to-peer copies its copy-engine all-gathers (train.fsdp_all_gather) make."""
    return kind_of(kernel) == "collectives"


def kind_of(kernel: str) -> str:
    """A kernel's kind by its name: matmul, attention, fused elementwise (inductor's Triton), ..."""
    name = kernel.lower()
    return next((kind for kind, keys in KINDS if any(k in name for k in keys)), "other")


def breakdown(prof, steps: int) -> dict:
    """A profile of `steps` steps, per step: the span from the first kernel to the last, the time some compute
    kernel runs, NCCL collectives' time and the part of it no compute kernel hides, idle time (nothing runs:
    launch gaps, host work, waits); and each kind's kernel time (kind_of)."""
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and e.time_range.end > e.time_range.start
        and not getattr(e, "is_user_annotation", False)
    ]  # GPU-side record_function ranges are no kernels
    nccl = union([(e.time_range.start, e.time_range.end) for e in kernels if is_collective(e.name)])
    comp = union([(e.time_range.start, e.time_range.end) for e in kernels if not is_collective(e.name)])
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    busy = union(nccl + comp)
    nccl_us = sum(e - s for s, e in nccl)
    kinds: dict[str, float] = {}
    for e in kernels:
        kinds[kind_of(e.name)] = kinds.get(kind_of(e.name), 0.0) + (e.time_range.end - e.time_range.start)
    ms = lambda us: round(us / steps / 1e3, 2)
    compute = sorted((e for e in kernels if not is_collective(e.name)), key=lambda e: e.time_range.start)
    return {
        "no_compute_windows": no_compute_windows(compute, nccl),
        "per_step_ms": {
            "span": ms(span),
            "compute": ms(sum(e - s for s, e in comp)),
            "collectives": ms(nccl_us),
            "collectives_exposed": ms(nccl_us - covered(nccl, comp)),
            "idle": ms(span - sum(e - s for s, e in busy)),
        },
        "kernel_ms_per_step": {k: ms(v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
    }


def no_compute_windows(compute: list, nccl: list[tuple[float, float]], top: int = 8) -> list[dict]:
    """The `top` longest stretches in which no compute kernel runs (`compute`: sorted by start): where each
    begins (ms from the first kernel), how long it is (ms), how much of it a collective fills, and the
    compute kernels on either side: where the step waits on communication or on the host."""
    windows, end, before = [], compute[0].time_range.end, compute[0]
    for e in compute[1:]:
        if e.time_range.start > end:
            windows.append((e.time_range.start - end, end, before, e))
        if e.time_range.end > end:
            end, before = e.time_range.end, e
    t0 = compute[0].time_range.start
    return [
        {
            "at_ms": round((s - t0) / 1e3, 2),
            "ms": round(d / 1e3, 3),
            "collective_ms": round(covered([(s, s + d)], nccl) / 1e3, 3),
            "after": a.name[:60],
            "before": b.name[:60],
        }
        for d, s, a, b in sorted(windows, key=lambda w: -w[0])[:top]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--timed", type=int, default=30, help="steps timed without the profiler")
    ap.add_argument("--steps", type=int, default=5, help="steps recorded by the profiler")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--trace", help="folder for rank 0's Chrome trace")
    ap.add_argument("--top", type=int, default=12, help="rows of the per-kernel table")
    args = ap.parse_args()

    # no activation checkpointing (what the trainer's memory plan picks for GPT-2 124M on an 80 GB card)
    base = ["model.preset=gpt2-124m", "train.device=cuda", "train.activation_checkpointing=none"]
    cfg = load_recipe("smoke", [*base, *args.overrides])
    d = setup_distributed(cfg)
    rank, world = d.rank, d.world
    t = cfg.train
    torch.manual_seed(t.seed)
    gcfg = model_config(cfg.model, 50257)
    raw = GPT(gcfg).to(d.device)
    model, autocast = prepare_model(raw, cfg, d)  # exactly as the trainer: DDP with more than one rank, compile
    optimizer = AdamW(raw.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), fused=True)  # the trainer's
    params = list(raw.parameters())
    data = torch.randint(0, 50257, (args.batch, gcfg.block_size + 1), device=d.device)

    def batch():
        return data[:, :-1], data[:, 1:]

    parts = StepParts(model, params, optimizer, autocast, world > 1, t.grad_clip)

    def step():
        train_step(parts, batch, 1, t.lr)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.timed):
        step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / args.timed * 1e3

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        out = {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "world": world,
            "overrides": args.overrides,
            "step_ms": round(step_ms, 2),
            **breakdown(prof, args.steps),
        }
        print(json.dumps(out), flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top), flush=True)
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace) / f"ddp-{world}gpu.json"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
