"""Time the seconds a training loop is blocked by a sharded (DCP) checkpoint under FSDP2: async against sync.

    torchrun --standalone --nproc_per_node 4 tests/benchmarks/bench_sharded_checkpoint.py --preset llama-8b \\
        --dir /tmp/lmyard-bench-dcp

Model: a preset of lmyard.models.llama where that module exists (made on the meta device, FSDP2 per block and at the
root with bf16 compute and fp32 gradient reduction, lmyard.train.distributed.parallel.apply_fsdp), else a stack of bias-free
Linear pairs of the same parameter count (`--params`, default the Llama-3 8B count), FSDP2 the same way.
Fused AdamW; two steps on random tokens make its state. Then, on every rank:
- sync: `dcp.save` of the same state to the node-local staging folder: the loop stops for all of it;
- async, staged in the loop (ShardedCheckpointer(async_staging=False)): the time prepare() takes to make
  the pinned host buffers in the background (as a trainer calls it after its first step), then for
  `--saves` saves the blocked time of save() (the copy into pinned memory; DCP's write runs in a thread),
  the wall time of the training step that follows it, and the extra wall time of that step and the
  `--after` steps after it over as many plain steps (the background write, hashing and upload share the
  host with the loop);
- async, staged on a side stream (async_staging=True): save() plus the before_update() wait after the
  next forward and backward (the copy overlaps them), and that step's wall time;
- background, per save: seconds from save() until this rank's files are written to the staging folder
  (`written_s`), uploaded into the store (`uploaded_s`: sha256, then a rename into the store folder,
  `--upload rename`, the default, as into a local store on the staging filesystem; or a copy, `--upload
  copy`, what an object store costs at disk speed) and committed by rank 0 (`committed_s`), and the bytes per rank;
- read: the last checkpoint's files (`--write-threads` a rank, 4 by default as checkpoint.files_per_rank)
  read back whole by the ranks in parallel (each a share of them, up to 4 files at once as the load reads
  them, 64 MiB reads into a buffer, nothing else done with them), after asking the kernel to drop them from its page
  cache (POSIX_FADV_DONTNEED, which a sandboxed kernel may ignore): the disk's read rate for these files;
- load: `load_sharded` of the last checkpoint into the model, files read in place (with their sha256), after
  the same request to drop them from the cache; its time over the read's is the resume's overhead. Then
  each rank's load time and its seconds per phase (load_sharded's `phases`: read, hash, reuse, wait on the
  read-ahead's threads, deserialise and copy on the loading thread). `--warm` times both with the files in
  the page cache instead (a read first): what the load costs the CPU per byte, whatever the disk.
Prints one JSON line per phase (the max over ranks) and a summary line. Disk: the state, 12 bytes a
parameter (fp32 weights + AdamW moments; 96 GB for 8B), twice with --upload copy; checked before it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

from lmyard.checkpoint import dcp as sc  # noqa: E402
from lmyard.checkpoint import dcp_load  # noqa: E402
from lmyard.layout import RunLayout  # noqa: E402
from lmyard.run import Run  # noqa: E402
from lmyard.store import LocalStore  # noqa: E402

RUN = "bench-dcp"


class CopyStore(LocalStore):
    """A local store that copies uploads (as an object store would) even on the staging filesystem."""

    def local_path(self, key: str) -> str | None:
        return None


def build_llama(preset: str, device: torch.device, seq: int):
    from lmyard.config import ModelConfig
    from lmyard.models.llama.model import Llama
    from lmyard.models.registry import model_config
    from lmyard.train.distributed.parallel import apply_fsdp, fsdp_mesh

    cfg = model_config(ModelConfig(preset=preset), 128256)
    with torch.device("meta"):
        model = Llama(cfg)
    apply_fsdp(model, fsdp_mesh(dist.get_world_size(), device), device)
    model.to_empty(device=device)
    model.init_weights()
    idx = torch.randint(0, cfg.vocab_size, (1, seq + 1), device=device)
    return model, lambda: model(idx[:, :-1], idx[:, 1:]), f"lmyard.models.llama {preset}"


def build_stack(params: float, device: torch.device, seq: int, d: int = 4096, layers: int = 32):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ff = max(1, int(params / (layers * 2 * d)))
    with torch.device("meta"):
        model = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(d, ff, bias=False), nn.GELU(), nn.Linear(ff, d, bias=False))
                for _ in range(layers)
            )
        )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    x = torch.randn(seq, d, device=device)
    return model, lambda: model(x).float().square().mean(), f"Linear stack d={d} ff={ff} x{layers}"


def train_step(model, opt, loss_fn, before_update=None) -> None:
    loss_fn().backward()
    if before_update is not None:
        before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


def gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def worst(value) -> float:
    """The max over ranks (a loop is as slow as its slowest rank)."""
    out = gather(value)
    return max(out) if not isinstance(value, dict) else {k: max(o[k] for o in out) for k in value}


def say(rank: int, line: dict) -> None:
    if rank == 0:
        print(json.dumps(line), flush=True)


def sync_save(model, opt, folder: str, group) -> float:
    def save():
        dcp.save(sc.state_dict(model, opt), storage_writer=dcp.FileSystemWriter(folder), process_group=group)

    try:
        return timed(save)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def async_saves(model, opt, loss_fn, store, staging: str, stream: bool, a, rank: int, base_s: float) -> list[dict]:
    ckpt = sc.ShardedCheckpointer(
        Run(RUN, store),
        staging,
        async_staging=stream,
        write_threads=a.write_threads,
        say=lambda s: print(s, flush=True),
    )
    t0 = time.perf_counter()
    ckpt.prepare(model, opt)  # as a trainer does after its first step: the pinned buffers, in the background
    if ckpt.prepared is not None:  # None on CPU: nothing pinned, nothing kept between saves
        ckpt.prepared.result()
    rows = [worst({"prepare_s": time.perf_counter() - t0})]
    for i in range(a.saves):
        step = 1000 * (2 if stream else 1) + i
        synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        blocked = ckpt.save(
            model,
            opt,
            {
                "step": step,
                "cursor": 0,
                "tokens_seen": 0,
                "world_size": dist.get_world_size(),
                "shard_address": "random",
                "config": {},
                "model": {},
            },
            [],
        )
        train_step(model, opt, loss_fn, ckpt.before_update)
        synchronize()
        step_s = time.perf_counter() - t0
        for _ in range(a.after):  # the steps while DCP writes and the files upload in the background
            train_step(model, opt, loss_fn)
        synchronize()
        extra_s = time.perf_counter() - t0 - (a.after + 1) * base_s
        ckpt.flush()
        timing = next(t for t in ckpt.timings if t["step"] == step)
        rows.append(
            worst(
                {
                    "blocked_s": ckpt.blocked_s[-1],
                    "save_call_s": blocked,
                    "step_with_save_s": step_s,
                    f"extra_wall_s_over_{a.after + 1}_steps": extra_s,
                    "written_s": timing["written_s"],
                    "uploaded_s": timing["uploaded_s"],
                    "committed_s": timing.get("committed_s", 0.0),
                    "bytes_per_rank": timing["bytes"],
                }
            )
        )
        dist.barrier()
        if i + 1 < a.saves and rank == 0:  # keep the disk to one checkpoint in the store
            store.delete(RunLayout(RUN).step(step))
    ckpt.close()
    return rows


def checkpoint_files(root: Path, step: int) -> list[Path]:
    return sorted(f for f in (root / "store" / RunLayout(RUN).step(step)).rglob("*") if f.is_file())


def drop_cached(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_back(files: list[Path], rank: int, world: int, lanes: int = 4) -> dict:
    """This rank's share of the files read whole, `lanes` files at once (as many as the load reads at once,
    readahead.LANES), 64 MiB at a time into a buffer each: bytes and seconds."""
    from concurrent.futures import ThreadPoolExecutor

    def read(f: Path) -> int:
        buf, n = bytearray(64 << 20), 0
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
        return n

    mine = files[rank::world]
    dist.barrier()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(lanes, len(mine)))) as pool:
        n = sum(pool.map(read, mine))
    return {"bytes": n, "seconds": time.perf_counter() - t0}


def check_disk(root: Path, need: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < 1.1 * need:
        raise SystemExit(
            f"{root}: {free / 2**30:.0f} GiB free, this run writes up to {need / 2**30:.0f} GiB on this "
            "node; pass --dir on a larger disk, --upload rename, or a smaller --preset/--params"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-8b", help="a preset of lmyard.models.llama")
    p.add_argument("--params", type=float, default=8.03e9, help="parameters of the Linear stack fallback")
    p.add_argument("--stack", action="store_true", help="use the Linear stack instead of the Llama preset")
    p.add_argument("--seq", type=int, default=2048, help="tokens per rank per step")
    p.add_argument("--saves", type=int, default=2, help="saves per async mode")
    p.add_argument("--after", type=int, default=9, help="steps timed after each save's step (background work)")
    p.add_argument("--dir", default="/tmp/lmyard-bench-dcp", help="node-local folder for staging and store")
    p.add_argument(
        "--upload",
        choices=["copy", "rename"],
        default="rename",
        help="copy: files are copied into the store (needs 2x the state on disk); rename: moved",
    )
    p.add_argument(
        "--write-threads",
        type=int,
        default=4,
        help="files per rank (DCP writer threads; checkpoint.files_per_rank, 4 by default as in the trainer)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--no-sync", action="store_true", help="skip the synchronous dcp.save row")
    p.add_argument("--width", type=int, default=4096, help="d of the Linear stack")
    p.add_argument(
        "--warm",
        action="store_true",
        help="time the read and the load with the files in the page cache (no POSIX_FADV_DONTNEED; a read first)",
    )
    return p.parse_args()


def main() -> None:
    a = parse_args()
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:  # a smoke run of the script itself (tiny --params, --stack)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if a.stack:
            raise ImportError("--stack")
        model, loss_fn, what = build_llama(a.preset, device, a.seq)
    except (ImportError, AttributeError, TypeError) as e:  # no lmyard.models.llama here, or another interface
        say(rank, {"note": f"lmyard.models.llama not used ({e}): a Linear stack of {a.params:.3g} parameters"})
        model, loss_fn, what = build_stack(a.params, device, a.seq, a.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    for _ in range(2):
        train_step(model, opt, loss_fn)
    step_s = worst(timed(lambda: [train_step(model, opt, loss_fn) for _ in range(5)]) / 5)  # back to back
    n = sum(p.numel() for p in model.parameters())
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    say(
        rank,
        {
            "model": what,
            "params": n,
            "ranks": world,
            "device": card,
            "torch": torch.__version__,
            "state_bytes_per_rank": n * 12 // world,
            "step_s": round(step_s, 3),
        },
    )

    root = Path(a.dir) / "bench-sharded-checkpoint"  # its own subfolder: emptied at the start and the end
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_disk(root, n * 12 * (2 if a.upload == "copy" else 1) * per_node // world)
    store = (CopyStore if a.upload == "copy" else LocalStore)(str(root / "store"))
    gloo = dist.new_group(backend="gloo")
    results = {}
    if not a.no_sync:
        sync_s = worst(sync_save(model, opt, str(root / "sync" / f"rank_{rank:05d}"), gloo))
        say(rank, {"phase": "sync dcp.save to node-local disk", "blocked_s": round(sync_s, 3)})
        results["sync_blocked_s"] = sync_s
    # before torch 2.12 the writer stages (no side stream): one mode; its first save makes the pinned buffers
    modes = (False, True) if sc._torch_at_least(2, 12) else (False,)
    for stream in modes:
        rows = async_saves(model, opt, loss_fn, store, str(root / "staging"), stream, a, rank, step_s)
        mode = "async, staged on a side stream" if stream else "async, staged in the loop"
        for i, row in enumerate(rows):
            say(rank, {"phase": mode, **({"save": i} if i else {}), **{k: round(v, 3) for k, v in row.items()}})
        results[mode] = rows[-1]["blocked_s"]
    last = 1000 * (2 if modes[-1] else 1) + a.saves - 1
    files = checkpoint_files(root, last)
    if a.warm:  # both timed passes find the files in the page cache: the CPU's cost per byte, not the disk's
        read_back(files, rank, dist.get_world_size())
    else:
        drop_cached(files[rank :: dist.get_world_size()])
    got = read_back(files, rank, dist.get_world_size())
    total = sum(o["bytes"] for o in gather(got))
    read_s = worst(got["seconds"])
    say(
        rank,
        {
            "phase": "read the checkpoint's files (all ranks)",
            "bytes": total,
            "seconds": round(read_s, 3),
            "gb_per_s": round(total / read_s / 1e9, 2),
        },
    )
    if not a.warm:
        drop_cached(files[rank :: dist.get_world_size()])
    phases: dict = {}
    mine = timed(
        lambda: dcp_load.load_sharded(
            Run(RUN, LocalStore(str(root / "store"))), last, model, opt, str(root / "cache"), phases=phases
        )
    )
    load_s = worst(mine)
    say(rank, {"phase": "load_sharded (resume), files read in place", "seconds": round(load_s, 3)})
    per_rank = gather({"seconds": mine, **phases})
    say(
        rank,
        {
            "phase": "load_sharded per rank: seconds, then seconds per phase (threads overlap)",
            "ranks": [{k: round(v, 3) for k, v in r.items()} for r in per_rank],
        },
    )
    say(
        rank,
        {
            "summary": "loop blocked per checkpoint, s (max over ranks, last save)",
            **{k: round(v, 3) for k, v in results.items()},
            "load_s": round(load_s, 3),
            "read_s": round(read_s, 3),
            "load_over_read": round(load_s / read_s, 2),
        },
    )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
