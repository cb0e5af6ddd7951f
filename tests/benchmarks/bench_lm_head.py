"""The LM head + loss on a GPU: lmyard.models.losses' fused op against the plain linear + cross-entropy.

    python tests/benchmarks/bench_lm_head.py [--tokens 32768] [--sweep]

Both paths under torch.compile and bf16 autocast, as in the trainer: x (tokens, 768) fp32,
the tied weight (50,304 x 768) fp32. Checks first that the fused op's loss and gradients
agree with the plain path's (exit 1 if not), then times forward + backward (median of
CUDA-event timings) and reads peak memory. `--sweep` also times the loss/gradient kernel
alone for several block sizes and warp counts, with the bandwidth it reached (one read
and one write of the bf16 logits). Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lmyard.models import losses
from lmyard.models.ops import cross_entropy


def median_ms(fn, n: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double())).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32 * 1024)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--sweep", action="store_true", help="also time the kernel for several BLOCK / num_warps")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.tokens, args.d, device=dev, generator=g).requires_grad_()
    w = (torch.randn(args.vocab, args.d, device=dev, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, 50257, (args.tokens,), device=dev, generator=g)

    def plain(a, b, t):
        return F.cross_entropy(F.linear(a, b).view(-1, args.vocab), t)

    paths = {"plain": torch.compile(plain), "fused": torch.compile(losses.linear_cross_entropy)}
    results = {}
    for name, fn in paths.items():

        def step(fn=fn):
            x.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(x, w, y)
            (loss * 0.5).backward()  # an upstream gradient other than 1, as with accumulation
            return loss

        loss = step()
        results[name] = {"loss": loss.detach(), "gx": x.grad.clone(), "gw": w.grad.clone()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results[name]["ms"] = median_ms(step)
        results[name]["peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    p, f = results["plain"], results["fused"]
    check = {
        "loss_diff": abs(p["loss"].item() - f["loss"].item()),
        "grad_x_rel": rel(f["gx"], p["gx"]),
        "grad_w_rel": rel(f["gw"], p["gw"]),
    }
    ok = check["loss_diff"] < 1e-3 and check["grad_x_rel"] < 2e-2 and check["grad_w_rel"] < 2e-2
    print(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "tokens": args.tokens,
                "vocab": args.vocab,
                "agree": ok,
                **{k: float(f"{v:.3g}") for k, v in check.items()},
                **{f"{k}_ms": round(r["ms"], 3) for k, r in results.items()},
                **{f"{k}_peak_gb": round(r["peak_gb"], 2) for k, r in results.items()},
                "speedup": round(p["ms"] / f["ms"], 3),
            }
        ),
        flush=True,
    )
    if not ok:
        sys.exit(1)
    if args.sweep:
        logits = torch.randn(args.tokens, args.vocab, device=dev, generator=g).mul_(2).to(torch.bfloat16)
        gb = 2 * logits.numel() * logits.element_size() / 1e9
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                cross_entropy.BLOCK, cross_entropy.NUM_WARPS = block, warps
                buf = logits.clone()
                ms = median_ms(lambda buf=buf: cross_entropy.loss_and_grad_triton(buf, y, True))
                print(
                    json.dumps(
                        {
                            "kernel": "ce_grad",
                            "BLOCK": block,
                            "num_warps": warps,
                            "ms": round(ms, 3),
                            "GB_per_s": round(gb / ms * 1e3),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
