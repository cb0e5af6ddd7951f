"""What making a checkpoint's pinned host buffers in a background thread costs the training thread.

    python tests/benchmarks/bench_pinned.py                     # llama-1b's state, fp32 weights + AdamW moments
    python tests/benchmarks/bench_pinned.py --gb 2              # a smaller state of the same tensors' shapes

The training thread launches bf16 matmuls (20 of 4096 x 4096 a timed iteration, synchronized) while a
second thread makes buffers of llama-1b's tensors' shapes, three times over (weights and two moments), the
way the checkpointers make their copy buffers after a run's first step. Each way runs in its own process
(torch keeps freed pinned memory cached): `none` (no buffers: the baseline), `torch`
(`torch.empty(..., pin_memory=True)`: cudaHostAlloc) and `lmyard` (lmyard.checkpoint.pinned.pinned_empty:
pages populated as ordinary memory, then cudaHostRegister). It prints, per way, one JSON line: the GB made,
the seconds the buffers took, the iteration's median time before, the longest iteration meanwhile, and the
launch time lost (the iterations' time beyond the median, from the start of the buffers to 2 s after), and
whether an asynchronous copy into a buffer is exact. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def shapes(gb: float) -> list[tuple[int, ...]]:
    """llama-1b's tensors (untied head), x3, cut to about `gb` GB of fp32."""
    V, D, F, KV, L = 128256, 2048, 8192, 512, 16
    layer = [(D, D), (KV, D), (KV, D), (D, D), (F, D), (F, D), (D, F), (D,), (D,)]
    out, total = [], 0.0
    for s in ([(V, D)] + layer * L + [(D,), (V, D)]) * 3:
        if total >= gb:
            break
        out.append(s)
        total += math.prod(s) * 4 / 1e9
    return out


def one(way: str, gb: float) -> dict:
    import torch

    from lmyard.checkpoint.pinned import pinned_empty

    torch.cuda.set_device(0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    times: list[tuple[float, float]] = []
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
            times.append((t0, time.perf_counter() - t0))

    trainer = threading.Thread(target=train)
    trainer.start()
    time.sleep(2.0)
    bufs: list = []

    def make() -> None:
        torch.cuda.set_device(0)
        for s in shapes(gb):
            bufs.append(torch.empty(s, pin_memory=True) if way == "torch" else pinned_empty(s, torch.float32))

    t0 = time.perf_counter()
    if way != "none":
        maker = threading.Thread(target=make)
        maker.start()
        maker.join()
    t1 = time.perf_counter()
    time.sleep(2.0)
    stop.set()
    trainer.join()
    base = statistics.median(d for t, d in times if t < t0)
    during = [d for t, d in times if t0 <= t < t1]
    exact = None
    if bufs:
        x = torch.randn(bufs[1].shape, device="cuda")
        bufs[1].copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        exact = bool(torch.equal(bufs[1], x.cpu()))
    return {
        "way": way,
        "GB": round(sum(b.numel() * 4 for b in bufs) / 1e9, 2),
        "buffers_s": round(t1 - t0, 2),
        "iteration_ms": round(base * 1e3, 2),
        "longest_ms_meanwhile": round(max(during) * 1e3, 1) if during else None,
        "launch_time_lost_s": round(sum(max(0.0, d - base) for t, d in times if t >= t0), 2),
        "copy_exact": exact,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=100.0, help="at most this many GB (default: all of llama-1b's 18)")
    p.add_argument("--way", choices=["none", "torch", "lmyard"], help="one way, in this process")
    a = p.parse_args()
    if a.way:
        print(json.dumps(one(a.way, a.gb)), flush=True)
        return
    for way in ("none", "torch", "lmyard"):
        subprocess.run([sys.executable, __file__, "--gb", str(a.gb), "--way", way], check=True)


if __name__ == "__main__":
    main()
