"""The optimizer step on a GPU: clip + torch's fused AdamW against lmyard.train.optim's clipped update.

    python tests/benchmarks/bench_optimizer.py [--preset llama-8b] [--shards 4] [--steps 20] [--sweep]
        [--param-dtype bfloat16]

The parameters of one rank: a preset's tensors, each cut to 1/shards of its rows (FSDP2's dim-0
shard), fp32, with fp32 gradients, in AdamW's two groups (decay on matrices). Each side runs
`--steps` steps from the same weights and gradients: the global norm, the clip to 1.0, AdamW
(lr 3e-4, betas 0.9 / 0.95, weight decay 0.1); timed with CUDA events (median step), then
its weights are compared with the other side's (largest relative difference). The traffic
each side needs is printed beside its time: torch's path reads the gradients for the norm,
reads and writes them for the clip, then AdamW reads weight, gradient and both moments and
writes weight and moments; the fused step does the norm's read and AdamW's, the clip inside it.
`--param-dtype bfloat16` gives lmyard's side the trainer's bf16 shards (train.fsdp_param_dtype): bf16
weights and gradients, float32 masters and moments in the optimizer's state; the kernel reads the bf16
gradient and writes the master and the bf16 weight: 30 bytes a parameter with the norm's read, against
32 for float32. Its weights are compared with torch's float32 ones. `copy_tb_s` is a plain device copy
of lmyard's bytes, the card's rate for that traffic.
`--sweep` also times the kernel for several block sizes and warp counts. Each step is queued while the GPU
is kept busy, so its time is the GPU's, as in training, where the host runs ahead. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lmyard.train import optim


def shard_shapes(preset: str, shards: int) -> list[torch.Size]:
    """Each parameter's shape on one of `shards` ranks (rows split, rounded up), from the preset on meta."""
    from lmyard.models.registry import build_model
    from lmyard.recipes import load_recipe

    cfg = load_recipe("smoke", [f"model.preset={preset}"])
    with torch.device("meta"):
        model = build_model(cfg.model, 50257)
    return [torch.Size([-(-p.shape[0] // shards), *p.shape[1:]]) for p in model.parameters()]


def make(shapes: list[torch.Size], fused: bool, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]
    grads = [(torch.randn(s, device="cuda", generator=g) * 1e-3).to(dtype) for s in shapes]
    if dtype != torch.float32:  # bf16 weights, their float32 values kept as the optimizer's masters
        low = [torch.nn.Parameter(p.detach().to(dtype)) for p in params]
        for p, q in zip(params, low):
            optim.keep_master(q, p.detach())
        params = low
    for p, grad in zip(params, grads):
        p.grad = grad
    groups = [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]
    cls = optim.AdamW if fused else torch.optim.AdamW
    return params, cls(groups, lr=3e-4, betas=(0.9, 0.95), fused=True)


def torch_step(params, opt) -> None:
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    opt.step()


def lmyard_step(params, opt) -> None:
    optim.clipped_update(params, opt, 1.0)


def run(shapes, fused: bool, steps: int, dtype: torch.dtype = torch.float32) -> tuple[float, list[torch.Tensor]]:
    """Median ms a step over `steps` (after 3 untimed), and a few of the weights after them (on the CPU)."""
    params, opt = make(shapes, fused, dtype)
    grads = [p.grad.clone() for p in params]  # torch's clip scales them in place: each step starts from these
    step = lmyard_step if fused else torch_step
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(steps + 3):
        torch._foreach_copy_([p.grad for p in params], grads)
        torch.cuda._sleep(50_000_000)  # the GPU busy while the host queues the step: in training the host runs ahead
        start.record()
        step(params, opt)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    kept = [p.detach().float().cpu() for p in params[:4]]
    del params, opt
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2], kept


def copy_ms(gb: float) -> float:
    """Median ms of a device-to-device copy moving `gb` GB (half read, half written)."""
    src = torch.empty(int(gb * 1e9 / 2), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--shards", type=int, default=4, help="FSDP2 ranks the parameters are split over")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32", help="lmyard's side's shards")
    a = ap.parse_args()
    dtype = getattr(torch, a.param_dtype)
    shapes = shard_shapes(a.preset, a.shards)
    n = sum(s.numel() for s in shapes)
    gb = n * 4 / 1e9  # one fp32 pass over every parameter
    # lmyard's traffic a parameter: the norm's read of the gradient, then AdamW's reads (master, gradient,
    # moments) and writes (master, moments, and the bf16 weight beside a master)
    low = dtype != torch.float32
    fused_gb = n * ((2 + 4 + 2 + 8 + 4 + 8 + 2) if low else 32) / 1e9
    ms_torch, w_torch = run(shapes, False, a.steps)
    ms_fused, w_fused = run(shapes, True, a.steps, dtype)
    diff = max(((x - y.to(dtype).float()).norm() / y.norm()).item() for x, y in zip(w_fused, w_torch))
    row = {
        "device": torch.cuda.get_device_name(),
        "preset": a.preset,
        "shards": a.shards,
        "params_per_rank": n,
        "torch_ms": round(ms_torch, 2),
        "torch_tb_s": round(10 * gb / ms_torch, 2),  # norm 1 + clip 2 (read, write) + AdamW 7 (4 reads, 3 writes)
        "param_dtype": a.param_dtype,
        "lmyard_ms": round(ms_fused, 2),
        "lmyard_tb_s": round(fused_gb / ms_fused, 2),
        "copy_tb_s": round(fused_gb / copy_ms(fused_gb), 2),
        "speedup": round(ms_torch / ms_fused, 3),
        "weights_rel_diff": diff,
    }
    print(json.dumps(row), flush=True)
    if a.sweep:
        for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)):
            optim.BLOCK, optim.NUM_WARPS = block, warps
            ms, _ = run(shapes, True, a.steps, dtype)
            print(json.dumps({"block": block, "num_warps": warps, "lmyard_ms": round(ms, 2)}), flush=True)


if __name__ == "__main__":
    main()
