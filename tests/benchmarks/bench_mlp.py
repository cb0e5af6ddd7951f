"""GPT-2's MLP on a GPU: lmyard.models.mlp's cuBLASLt epilogues against the plain compiled ops.

    python tests/benchmarks/bench_mlp.py [--tokens 32768] [--d 768]

Both paths under torch.compile and bf16 autocast, as in the trainer: x (tokens, d) bf16 (the
residual stream of train.residual_dtype=bfloat16), fc (d -> 4d) and proj (4d -> d) fp32 with
biases. Checks first that the fused op's output and gradients agree with the plain path's (exit 1
if not), then times forward + backward: the median wall time of a call (CUDA events; at one MLP a
call the host's launches can be the bound) and the GPU's kernel time in it (torch.profiler: what the
MLP costs inside a training step, where the host runs ahead). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_lm_head import median_ms, rel

from lmyard.models import mlp
from lmyard.models.ops import cublaslt


def kernel_ms(fn, n: int = 5) -> float:
    """Kernel time per call on the GPU (the sum of the CUDA kernels' durations), over n calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.end - e.time_range.start for e in cuda) / n / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32 * 1024)
    ap.add_argument("--d", type=int, default=768)
    args = ap.parse_args()
    torch.manual_seed(0)
    fc, proj = nn.Linear(args.d, 4 * args.d).cuda(), nn.Linear(4 * args.d, args.d).cuda()
    x = torch.randn(args.tokens, args.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.tokens, args.d, device="cuda", dtype=torch.bfloat16)
    params = [x, *fc.parameters(), *proj.parameters()]

    def step(fn):
        def run():
            for p in params:
                p.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = fn(x)
            y.backward(dy)
            return [y.detach(), *(p.grad for p in params)]

        return run

    plain = step(torch.compile(lambda a: proj(F.gelu(fc(a), approximate="tanh"))))
    fused = step(torch.compile(lambda a: mlp.gelu_mlp(a, fc, proj)))
    errors = [rel(f.float(), p.float()) for f, p in zip(fused(), plain())]
    planned = sorted(cublaslt.planned())
    out = {
        "gpu": torch.cuda.get_device_name(0),
        "tokens": args.tokens,
        "d": args.d,
        "plain_ms": round(median_ms(plain), 3),
        "fused_ms": round(median_ms(fused), 3),
        "plain_kernel_ms": round(kernel_ms(plain), 3),
        "fused_kernel_ms": round(kernel_ms(fused), 3),
        "cublaslt_epilogues": planned,
        "rel_errors": [round(e, 5) for e in errors],
    }
    print(json.dumps(out), flush=True)
    if max(errors) > 2e-2 or planned != ["dgelu", "gelu_aux_bias"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
