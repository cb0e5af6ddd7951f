"""Causal attention's forward + backward on one GPU, per backend, at a Llama shape (default: Llama-3 8B's).

    python tests/benchmarks/bench_attention.py [--seq 8192] [--heads 32] [--kv-heads 8] [--head-dim 128]

bf16 q (batch, heads, seq, head_dim) and k, v with kv-heads heads, causal. Rows: SDPA with
`enable_gqa` as lmyard's Llama calls it (PyTorch's choice of backend, then cuDNN and flash forced),
SDPA on k and v repeated to every head (as torchtitan 0.2.2 calls it), compiled FlexAttention with
a causal BlockMask, and, where the flash-attn-4 package is installed, SDPA's flash backend through
FlashAttention-4 (model.attention=fa4, lmyard.models.ops.flash4). Each row: the mean wall time of a
forward + backward over 20 calls, the TFLOP/s that makes (causal: half of 4 x seq^2 x head_dim per
head forward, backward 2.5x the forward), and the kernels that took the most time in one call.
Prints one JSON line a row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(make, dy: torch.Tensor, leaves: list[torch.Tensor], backend: SDPBackend | None, calls: int = 20) -> dict:
    def call():
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            y = make()
        y.backward(dy)
        for t in leaves:
            t.grad = None

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / calls * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:80]] = kernels.get(e.name[:80], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:3]
    return {"ms": round(ms, 3), "top_kernels_ms": {name: round(t, 3) for name, t in top}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py times CUDA kernels: run it on a machine with a GPU")
    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, **bf16)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, **bf16)
    v = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, **bf16)
    dy = torch.randn_like(q, requires_grad=False)
    flops = 4 * a.batch * a.heads * a.seq**2 * a.head_dim / 2 * 3.5
    groups = a.heads // a.kv_heads

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)

    def repeated():
        kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, a.seq, a.seq, device="cuda")
    flex = torch.compile(flex_attention)
    rows = [
        ("sdpa enable_gqa, PyTorch's choice (lmyard)", gqa, None),
        ("sdpa enable_gqa, cudnn", gqa, SDPBackend.CUDNN_ATTENTION),
        ("sdpa enable_gqa, flash", gqa, SDPBackend.FLASH_ATTENTION),
        ("sdpa repeated k/v, cudnn (torchtitan)", repeated, SDPBackend.CUDNN_ATTENTION),
        ("flex_attention causal, compiled", lambda: flex(q, k, v, block_mask=mask, enable_gqa=groups > 1), None),
    ]
    from lmyard.models.ops import flash4

    fa4 = flash4.missing(q.device)
    if fa4 is None:  # last: from here on SDPA's flash backend runs FlashAttention-4
        rows.append(("sdpa enable_gqa, flash through FlashAttention-4 (model.attention=fa4)", gqa, "fa4"))
    for name, make, backend in rows:
        if backend == "fa4":
            flash4.activate()
            backend = SDPBackend.FLASH_ATTENTION
        try:
            out = timed(make, dy, [q, k, v], backend)
        except RuntimeError as e:  # a backend that does not take this shape on this GPU
            out = {"failed": str(e).splitlines()[0][:200]}
        if "ms" in out:
            out["tflops"] = round(flops / out["ms"] / 1e9, 1)
        print(json.dumps({"attention": name, "device": torch.cuda.get_device_name(), **out}), flush=True)
    if fa4 is not None:
        print(json.dumps({"attention": "FlashAttention-4 (model.attention=fa4)", "skipped": f"needs {fa4}"}))


if __name__ == "__main__":
    main()
