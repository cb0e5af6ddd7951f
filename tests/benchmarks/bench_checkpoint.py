"""Time the training loop is blocked per checkpoint: asynchronous save against a synchronous one.

    python tests/benchmarks/bench_checkpoint.py --presets gpt2-124m gpt2-1.5b [--store DIR]

For each model it trains on random tokens (bf16 autocast, torch.compile, fused
AdamW, T=1024) and measures:
- the median step time without checkpoints;
- FullCheckpointer.save(): the time the loop is blocked (the call itself) and
  the extra wall time of the 10 steps around it (the snapshot copy runs on a side
  stream, so the next update may wait for it), for the first save (which also
  allocates the pinned buffers) and a later one; and the background time until
  the checkpoint is committed;
- synchronously: the same state written by FullCheckpointer.save_state() + close() (copy, serialize,
  write, manifest), the time a loop without async saving would stop.
It prints one JSON line per model with the overhead at a checkpoint every
1,000 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lmyard.checkpoint.catalog import read_manifest  # noqa: E402
from lmyard.checkpoint.full import FullCheckpointer  # noqa: E402
from lmyard.checkpoint.state import rng_state  # noqa: E402
from lmyard.config import ModelConfig  # noqa: E402
from lmyard.models.gpt2.model import GPT  # noqa: E402
from lmyard.models.registry import model_config  # noqa: E402
from lmyard.run import Run  # noqa: E402
from lmyard.store import open_store  # noqa: E402


def bench(preset: str, batch: int, store_dir: str, interval: int) -> dict:
    torch.manual_seed(0)
    model = GPT(model_config(ModelConfig(preset=preset), 50257)).cuda()
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, fused=True)
    cmodel = torch.compile(model)
    x = torch.randint(0, 50257, (batch, 1025), device="cuda")
    store = open_store(store_dir)
    ckpt = FullCheckpointer(Run(f"bench-{preset}", store), f"{store_dir}/staging", say=lambda s: None)

    def step(before_update=None):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cmodel(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if before_update:
            before_update()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed_steps(n, save_at=None):
        times, blocked = [], None
        for i in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if i == save_at:
                blocked = ckpt.save(model, opt, {"step": 1000 + len(ckpt.blocked_s), "cursor": 0}, [rng_state()])
            step(ckpt.before_update)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times, blocked

    for _ in range(5):
        step()
    ckpt.prepare(model.state_dict(), opt.state_dict())  # as the trainer does after its first step
    t0 = time.perf_counter()
    while ckpt.prepare_job is not None:
        time.sleep(0.05)
    prepare_s = time.perf_counter() - t0
    base = statistics.median(timed_steps(10)[0])
    out = {
        "preset": preset,
        "params": model.num_params(),
        "batch": batch,
        "step_s": round(base, 4),
        "gpu": torch.cuda.get_device_name(0),
        "pinned_buffers_s": round(prepare_s, 2),
    }
    for label in ("first_async", "async"):
        times, blocked = timed_steps(10, save_at=2)
        t0 = time.perf_counter()
        ckpt.flush()
        out[label] = {
            "blocked_s": round(blocked, 4),
            "extra_wall_s": round(sum(times) - 10 * base, 4),
            "until_committed_s": round(time.perf_counter() - t0, 2),
        }
    ckpt.close()
    print(json.dumps({**out, "sync": "pending"}), flush=True)
    store.delete(f"runs/bench-{preset}")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sync = FullCheckpointer(Run(f"bench-{preset}-sync", store), f"{store_dir}/staging", say=lambda s: None)
    sync.save_state(model.state_dict(), opt.state_dict(), {"step": 1, "cursor": 0}, [rng_state()])
    sync.close()
    out["sync_s"] = round(time.perf_counter() - t0, 2)
    out["checkpoint_gb"] = round(read_manifest(Run(f"bench-{preset}-sync", store), 1).bytes / 1e9, 2)
    cost = max(out["async"]["blocked_s"], out["async"]["extra_wall_s"])
    out["async_vs_sync"] = round(cost / out["sync_s"], 4)
    out[f"overhead_at_interval_{interval}"] = round(cost / (interval * base), 5)
    store.delete(f"runs/bench-{preset}-sync")
    model = opt = cmodel = None  # the next preset gets the GPU memory back
    torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["gpt2-124m", "gpt2-1.5b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 8], help="micro-batch per preset")
    ap.add_argument("--store", default=None, help="checkpoint store (default: a temp folder)")
    ap.add_argument("--interval", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmyard-ckpt-bench-") as tmp:
        for preset, batch in zip(args.presets, args.batch):
            bench(preset, batch, args.store or tmp, args.interval)


if __name__ == "__main__":
    main()
