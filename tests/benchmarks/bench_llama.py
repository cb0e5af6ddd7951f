"""lmyard's Llama under FSDP2 on 1..N GPUs, beside torchtitan 0.2.2 on the same shape, tokens and settings.

    . .whl/titan/INSTALL.sh    # --titan on the GPU machines: torchtitan 0.2.2 and torchao 0.17 as wheels
    python tests/benchmarks/bench_llama.py --gpus 1 4 --preset llama-1b --seq 2048 --batch 4 --compile --titan
    python tests/benchmarks/bench_llama.py --gpus 1 --preset llama-1b --compile --titan --float8 none rowwise
    python tests/benchmarks/bench_llama.py --gpus 4 --preset llama-8b --seq 8192 --batch 1 --ac full --compile --titan
    python tests/benchmarks/bench_llama.py --gpus 4 --preset llama-8b --seq 8192 --batch 1 --ac selective --ac-blocks 14 --compile
    python tests/benchmarks/bench_llama.py --device cpu --gpus 2 --preset llama-tiny --seq 64 --batch 2 --steps 3 --warmup 1
    python tests/benchmarks/bench_llama.py --gpus 1 --preset llama-1b --seq 2048 --batch 4 --compile --doc-mask both
    python tests/benchmarks/bench_llama.py --gpus 1 --parallel ddp --preset llama-1b --compile --titan --float8 none rowwise

For each GPU count it runs `torchrun --nproc_per_node=N bench_llama.py --worker`: the model from
lmyard.models.build_model (made on the GPU, seeded), lmyard.parallel.parallelize (float8 -> activation
checkpointing -> torch.compile per block -> FSDP2 with bf16 parameters and fp32 reduction), or with
`--parallel ddp` the trainer's ddp path (lmyard.train.distributed.parallelism.prepare_model: float8, checkpointing, DDP
on several ranks, whole-model compile, bf16 autocast; on one GPU torchtitan's own path), fused AdamW,
gradient clipping at 1.0, one micro-batch per step, reading uniformly random GPT-2 token ids from a shard
file (tests/benchmarks/random_shards.py): rank r, step s takes sequences (s * world + r) * batch ... of
seq + 1 tokens. With `--titan` it then runs torchtitan 0.2.2's own trainer on the same shard, in the same
order, at the same shape, activation checkpointing, compile and precision (run_torchtitan.py).

`--float8` names one or more precisions, each run on both sides in turn: `none` (bf16), `tensorwise` or
`rowwise` (torchao float8 linears in the blocks with that scaling recipe: lmyard's train.float8 +
train.float8_recipe, torchtitan's float8 converter with the same recipe, its output head left in bf16 as
lmyard's). `--float8 none rowwise` gives a bf16 row and a float8 row per side and GPU count, each with its
lmyard / torchtitan ratio. On a GPU without float8 matmuls (compute capability < 8.9) lmyard skips float8 with
a warning; with `--device cpu` torchtitan runs it on the CPU (a dry run of the code path, not a measurement).

`--doc-mask on` trains with model.doc_mask (block-causal FlexAttention over packed documents,
lmyard.models.attention) instead of causal SDPA, `--doc-mask both` runs causal then doc-masked for each GPU
count. The shard's random ids hold an <|endoftext|> (50256) once in ~50k tokens, so doc-masked runs place
one at random positions, once per `--doc-len` tokens on average (default 1024, about FineWeb's mean
document): the mask's tiles then skip what a real corpus lets them skip. Causal runs read the shard as it is,
and so does `--trainer` (with `--doc-mask on`: the mask's cost with nearly one document per sequence).

Prints one JSON line per run and a summary: tokens/s, tokens/s per GPU, MFU = tokens/s * F / (peak * GPUs)
with F = lmyard.models.registry.flops_per_token = 6 * (parameters - input embedding) + 12 * layers * width * seq
(torchtitan's formula; peak dense bf16 989 TFLOP/s on H100/H200, lmyard.components.PEAK_FLOPS; a float8 row's
MFU is against the same bf16 peak), peak memory per GPU (max allocated and max reserved, GiB) beside
lmyard.memory's estimate, and lmyard / torchtitan per precision. `--json PATH` writes the rows to a file,
`--titan-log PATH` keeps torchtitan's whole output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

EOT = 50256  # GPT-2's <|endoftext|>: begins each document, as lmyard's shards write it
WORKER_ARGS = (
    "memory_gib",
    "all_gather",
    "embedding",
    "copies",
    "preset",
    "seq",
    "batch",
    "ac",
    "ac_blocks",
    "reduce",
    "param_dtype",
    "reshard",
    "parallel",
    "float8",
    "steps",
    "warmup",
    "profile",
    "optimizer",
    "device",
    "attention",
    "doc_mask",
    "doc_len",
)
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]


def timed_steps(model, params, opt, batch, warmup: int, steps: int, device, ctx) -> tuple[float, list]:
    """`warmup` untimed then `steps` timed optimizer steps, each forward in `ctx` (ddp: bf16 autocast);
    (seconds of the timed ones, losses)."""
    import torch

    from lmyard.train.optim import clipped_update

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses = []
    for step in range(warmup + steps):
        if step == warmup:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
        x, y = batch(step)
        with ctx:
            loss = model(x, y)
        loss.backward()
        clipped_update(params, opt, 1.0)  # the trainer's: lmyard's AdamW takes the clip's scale in its step
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync()
    return time.perf_counter() - t0, losses


def profiled(model, params, opt, batch, steps: int, device, ctx) -> dict:
    """`steps` more steps under torch.profiler (every rank records; each rank's own figures): the step split
    into compute, collectives (and their part no compute hides) and idle, kernel time per kind, the top kernels."""
    import torch
    from profile_ddp_step import breakdown
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(model, params, opt, batch, 0, steps, device, ctx)
    out = breakdown(prof, steps)
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            by_name[e.name[:160]] = by_name.get(e.name[:160], 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:40]
    out["top_kernels_ms_per_step"] = {name: round(us / steps / 1e3, 2) for name, us in top}
    return out


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lmyard.data.shards import read_shard
    from lmyard.models import attention
    from lmyard.models.ops import flash4
    from lmyard.models.registry import build_model, flops_per_token, model_spec
    from lmyard.recipes import load_recipe
    from lmyard.train.components import PEAK_FLOPS
    from lmyard.train.distributed.memory import resolve, use_expandable_segments
    from lmyard.train.distributed.parallel import block_params, copies_mode, init_process_group, parallelize
    from lmyard.train.distributed.parallelism import prepare_model

    rank, local, world = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    cuda = a.device == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        use_expandable_segments()  # as the trainer does (lmyard.train.distributed.memory)
        torch.cuda.set_device(device)
    cfg = load_recipe(
        "smoke",
        [
            f"model.preset={a.preset}",
            f"model.block_size={a.seq}",
            f"train.parallel={a.parallel}",
            f"train.micro_batch={a.batch}",  # what the memory plan (and auto) counts activations for
            f"train.batch_tokens={a.batch * a.seq * world}",
            *ac_overrides(a),
            f"train.compile={a.compile}",
            f"train.float8={a.float8 != 'none'}",
            f"train.float8_recipe={'tensorwise' if a.float8 == 'none' else a.float8}",
            f"train.fsdp_reshard_after_forward={a.reshard}",
            f"train.fsdp_reduce_dtype={a.reduce}",
            f"train.fsdp_param_dtype={a.param_dtype}",
            f"train.fsdp_embedding={a.embedding}",
            f"train.device={a.device}",
            f"model.doc_mask={a.doc_mask == 'on'}",
            f"train.fsdp_all_gather={a.all_gather}",
            f"train.fsdp_copies={a.copies}",
        ],
    )
    # the process group as the trainer makes it (lmyard.train.distributed.setup_distributed)
    gather = init_process_group(cfg.train, device, world, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    # auto settles here as in the trainer (lmyard.train.distributed.memory.resolve), with its startup line; none on CPU
    total = device_memory(device, a.memory_gib) if cuda else None
    train_cfg, line = resolve(cfg.model, cfg.train, world, total)
    cfg = cfg.model_copy(update={"train": train_cfg})
    if line and rank == 0:
        print(line, flush=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model, 50257, (EOT, None))
    n_params, flops_tok = model.num_params(), flops_per_token(model_spec(model))
    raw, ctx = model, contextlib.nullcontext()
    if a.parallel == "fsdp":
        model = parallelize(model, cfg, world, device)
    else:  # the trainer's ddp path: float8, checkpointing, DDP on several ranks, whole-model compile, autocast
        model, ctx = prepare_model(model, cfg, SimpleNamespace(world=world, local_rank=local, device=device))
    params = list(raw.parameters())
    from lmyard.train.optim import AdamW

    opt = (AdamW if a.optimizer == "lmyard" else torch.optim.AdamW)(
        raw.param_groups(0.1), lr=3e-4, betas=(0.9, 0.95), fused=cuda
    )
    tokens, B, T = read_shard(a.shard), a.batch, a.seq

    def batch(step: int):
        first = (step * world + rank) * B * (T + 1)
        rows = torch.from_numpy(tokens[first : first + B * (T + 1)].astype("int64")).view(B, T + 1)
        if a.doc_mask == "on":  # documents of --doc-len tokens on average, begun by <|endoftext|>
            g = torch.Generator().manual_seed(step * world + rank)
            rows[torch.rand(B, T + 1, generator=g) < 1 / a.doc_len] = EOT
        rows = rows.pin_memory().to(device, non_blocking=True) if cuda else rows
        return rows[:, :-1], rows[:, 1:]

    if a.attention == "fa4" and (lacks := flash4.missing(device)):
        raise SystemExit(f"--attention fa4 needs {lacks}")
    attention.use_kernel(a.attention)  # model.attention, as the trainer's ComputeContext sets it
    dt, losses = timed_steps(model, params, opt, batch, a.warmup, a.steps, device, ctx)
    tok_s = a.steps * B * T * world / dt
    peak = next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), None) if cuda else None
    out = {
        "impl": "lmyard+docmask" if a.doc_mask == "on" else "lmyard",
        "preset": a.preset,
        "params": n_params,
        "world": world,
        "B": B,
        "T": T,
        "parallel": a.parallel,
        "ac": a.ac,
        "ac_applied": cfg.train.activation_checkpointing,
        "ac_blocks": cfg.train.activation_checkpointing_blocks,
        "reshard": cfg.train.fsdp_reshard_after_forward if a.parallel == "fsdp" else None,  # as settled
        "all_gather": gather if a.parallel == "fsdp" else None,
        "embedding": type(getattr(raw, "embed_tokens", None)).__name__,  # ShardedEmbedding: in row shards
        "copies": copies_mode(cfg.train, device, world, block_params(raw)) if a.parallel == "fsdp" else None,
        "compile": a.compile,
        "float8": a.float8,
        "optimizer": a.optimizer,
        "param_dtype": a.param_dtype,
        "attention": a.attention,
        "doc_mask": a.doc_mask == "on",
        "tok_s": round(tok_s),
        "tok_s_per_gpu": round(tok_s / world),
        "step_ms": round(dt / a.steps * 1000, 1),
        "flops_per_token": flops_tok,
        "mfu": round(tok_s * flops_tok / (peak * world), 4) if peak else None,
        "loss_first": round(float(losses[0]), 4),
        "loss_last": round(float(losses[-1]), 4),
    }
    if cuda:
        from lmyard.train.distributed.memory import estimate

        plan = estimate(
            cfg.model,
            cfg.train.model_copy(update={"micro_batch": B}),
            world,
            total,
        )
        out["planned_gib"] = round(plan.total / 2**30, 2)  # lmyard.memory's estimate, beside the measured peak
        out["device"] = torch.cuda.get_device_name(device)
        out["memory_gib"] = a.memory_gib  # planned and capped at this, not the card's
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        out["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        out["segments"] = len(torch.cuda.memory_snapshot())  # a few with expandable segments
    if a.profile and cuda:  # after the timing: where the step's time goes (profile_ddp_step.breakdown)
        try:
            out["profile"] = profiled(model, params, opt, batch, a.profile, device, ctx)
        except Exception as e:  # the timed row stands without it
            out["profile"] = f"failed: {type(e).__name__}: {e}"
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def device_memory(device, gib: float | None) -> int:
    """The bytes lmyard plans against: the card's, or `gib` GiB (at most the card's) with the caching allocator
    capped there."""
    import torch

    card = torch.cuda.get_device_properties(device).total_memory
    if gib is None:
        return card
    capped = min(card, int(gib * 2**30))  # no more than the card has
    torch.cuda.set_per_process_memory_fraction(capped / card, device)
    return capped


def run_lmyard(a: argparse.Namespace, gpus: int, shard: Path) -> dict:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in WORKER_ARGS and v is not None]
    args += [f"--shard={shard}"] + [f"--{f.replace('_', '-')}" for f in ("compile",) if getattr(a, f)]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        str(Path(__file__).resolve()),
        "--worker",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"lmyard run failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(line[len("RESULT ") :])


def run_trainer(a: argparse.Namespace, gpus: int) -> dict:
    """lmyard's own trainer (`torchrun -m lmyard.dispatch train`, train.parallel=fsdp) on the same shape: its data loader,
    logging, guard and a checkpoint at the end included; tokens/s is the median of its logged intervals."""
    from bench_trainer import run_lmyard
    from random_shards import make_shards

    store = a.data / "trainer"
    steps = a.warmup + a.steps
    shards = make_shards(store, (steps + 2) * a.batch * a.seq * gpus + a.seq + 1)
    overrides = [
        f"model.preset={a.preset}",
        f"model.block_size={a.seq}",
        "train.parallel=fsdp",
        f"train.batch_tokens={a.batch * a.seq * gpus}",
        *ac_overrides(a),
        f"train.compile={str(a.compile).lower()}",
        f"model.attention={a.attention}",
        f"model.doc_mask={str(a.doc_mask == 'on').lower()}",  # on the shard as it is (see the docstring)
        f"train.fsdp_reshard_after_forward={a.reshard}",
        f"train.fsdp_reduce_dtype={a.reduce}",
        f"train.fsdp_param_dtype={a.param_dtype}",
        f"train.fsdp_embedding={a.embedding}",
        f"train.fsdp_all_gather={a.all_gather}",
        f"train.fsdp_copies={a.copies}",
        f"train.float8={str(a.float8 != 'none').lower()}",
        f"train.float8_recipe={'tensorwise' if a.float8 == 'none' else a.float8}",
        "eval.val_tokens=16384",
        "checkpoint.interval=100000",
    ]
    out = run_lmyard(
        store, shards, gpus, a.batch, steps, overrides, {}, log_interval=5, warmup_logs=max(1, a.warmup // 5)
    )
    return {"impl": "lmyard-trainer", **out}


def ac_overrides(a: argparse.Namespace) -> list[str]:
    """lmyard's activation checkpointing from --ac and --ac-blocks (the first N blocks)."""
    blocks = [] if a.ac_blocks is None else [f"train.activation_checkpointing_blocks={a.ac_blocks}"]
    return [f"train.activation_checkpointing={a.ac}", *blocks]


def titan_ac(ours: dict) -> str:
    """torchtitan's checkpointing for lmyard's row: what lmyard applied (selective or full on some blocks
    counts as that mode on every block; pointwise, which torchtitan lacks, as none)."""
    ac = ours.get("ac_applied") or ours["ac"]
    return "none" if ac == "pointwise" else ac


def run_titan(a: argparse.Namespace, gpus: int, ours: dict) -> dict | None:
    """torchtitan 0.2.2 (run_torchtitan.py) on the same shard, shape and precision as `ours` (lmyard's row),
    with lmyard's MFU formula applied to its tokens/s and the ratio lmyard / torchtitan; None, with its
    output's end on stderr, where torchtitan failed (the other rows still run)."""
    import run_torchtitan

    titan = argparse.Namespace(
        **{k: getattr(a, k) for k in ("preset", "seq", "batch", "compile", "float8", "device", "data")},
        attn=a.titan_attn,
        ac=a.titan_ac or titan_ac(ours),
        steps=max(a.warmup + a.steps, 25),  # torchtitan logs every 5 steps; its first two intervals are left out
        log_freq=5,
        warmup_logs=2,
        log=a.titan_log,
    )
    try:
        peer = run_torchtitan.run(titan, gpus)
    except SystemExit as failed:  # run_torchtitan's one-message failure: report it, keep lmyard's rows going
        print(f"torchtitan {gpus} GPU(s), float8 {a.float8}: {failed}", file=sys.stderr, flush=True)
        return None
    peer["mfu"] = round(ours["mfu"] * peer["tok_s"] / ours["tok_s"], 4) if ours["mfu"] else None  # the same F
    print(json.dumps(peer), flush=True)
    return {**peer, "lmyard_over_titan": round(ours["tok_s"] / peer["tok_s"], 3)}


def run_all(a: argparse.Namespace) -> list[dict]:
    """Per GPU count and per precision (--float8): lmyard's rows, then its trainer's and torchtitan's."""
    from run_torchtitan import ensure_shards

    rows: list[dict] = []
    steps = a.warmup + a.steps
    shard = ensure_shards(a.data, (max(steps, 25) + 1) * a.batch * (a.seq + 1) * max(a.gpus))
    modes = ["off", "on"] if a.doc_mask == "both" else [a.doc_mask]
    for gpus in a.gpus:
        for float8 in a.float8:
            p = argparse.Namespace(**{**vars(a), "float8": float8})
            for mode in modes:  # causal first: torchtitan's ratio is to the first
                rows.append(run_lmyard(argparse.Namespace(**{**vars(p), "doc_mask": mode}), gpus, shard))
                print(json.dumps(rows[-1]), flush=True)
            ours = rows[-len(modes)]
            if a.trainer:
                trainer = run_trainer(p, gpus)
                trainer.update(tok_s_per_gpu=round(trainer["tok_s"] / gpus), float8=float8)
                print(json.dumps(trainer), flush=True)
                rows.append(trainer)
            peer = run_titan(p, gpus, ours) if a.titan else None
            if peer is not None:
                if a.trainer:
                    peer["trainer_over_titan"] = round(trainer["tok_s"] / peer["tok_s"], 3)
                rows.append(peer)
            if a.json:  # after each GPU count and precision: a run cut short keeps what it measured
                a.json.write_text(json.dumps(rows, indent=1))
    return rows


def summary(rows: list[dict]) -> None:
    print(
        "\nimpl               GPUs  float8         tok/s  tok/s/GPU     MFU  peak reserved GiB/GPU  lmyard/torchtitan"
    )
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        ratio = f"{r['lmyard_over_titan']:.3f}x" if "lmyard_over_titan" in r else ""
        ratio += f" (trainer {r['trainer_over_titan']:.3f}x)" if "trainer_over_titan" in r else ""
        print(
            f"{r['impl']:<17} {r['world']:>5}  {r.get('float8', 'none'):<10} {r['tok_s']:>10,} {r['tok_s_per_gpu']:>10,}"
            f" {mfu:>7}  {r.get('peak_reserved_gib', '-')!s:>21}  {ratio}"
        )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1], help="GPU counts (ranks, with --device cpu)")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    ap.add_argument(
        "--ac",
        choices=["none", "pointwise", "selective", "full", "auto"],
        default="none",
        help="activation checkpointing; auto: the lightest that lmyard's memory plan fits (lmyard only: "
        "torchtitan gets what it settles to)",
    )
    ap.add_argument(
        "--ac-blocks",
        type=int,
        help="with --ac pointwise, selective or full: checkpoint only the first N blocks "
        "(train.activation_checkpointing_blocks; lmyard only: torchtitan gets the mode on every block)",
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (and torchtitan's loss)")
    ap.add_argument(
        "--float8",
        nargs="+",
        choices=["none", "tensorwise", "rowwise"],
        default=["none"],
        help="precisions, each run on both sides: none (bf16), or torchao float8 with this scaling recipe "
        "(lmyard's train.float8_recipe, torchtitan's quantize.linear.float8.recipe_name); e.g. `none rowwise`",
    )
    ap.add_argument(
        "--parallel",
        choices=["fsdp", "ddp"],
        default="fsdp",
        help="lmyard's train.parallel; ddp on one GPU is the plain path (bf16 autocast, no FSDP), as torchtitan's",
    )
    ap.add_argument(
        "--reshard",
        choices=("auto", "true", "false"),
        default="auto",
        help="lmyard's train.fsdp_reshard_after_forward (auto: false where the memory plan fits it); torchtitan reshards",
    )
    ap.add_argument(
        "--reduce",
        choices=["float32", "bfloat16"],
        default="float32",
        help="train.fsdp_reduce_dtype (lmyard only; torchtitan reduces in float32)",
    )
    ap.add_argument(
        "--param-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="train.fsdp_param_dtype (lmyard only): bfloat16 shards with float32 masters in lmyard's AdamW",
    )
    ap.add_argument(
        "--embedding",
        choices=["auto", "gathered", "sharded"],
        default="auto",
        help="train.fsdp_embedding (lmyard only): sharded looks the token table up in its row shards "
        "(lmyard.train.distributed.sharded_embedding); gathered: FSDP2 gathers it; auto: sharded where that moves less",
    )
    ap.add_argument(
        "--all-gather",
        choices=["auto", "nccl", "copy_engine"],
        default="auto",
        help="train.fsdp_all_gather (lmyard only): copy_engine gathers through NCCL's copy engines, nccl through "
        "its kernels; auto: copy_engine where it can run (the trainer's default)",
    )
    ap.add_argument(
        "--copies",
        choices=["auto", "compute", "side"],
        default="auto",
        help="train.fsdp_copies (lmyard only): side runs FSDP2's split of each all-gather and cat before each "
        "reduce-scatter on its side streams (lmyard.train.distributed.fsdp_copies); compute: on the compute stream",
    )
    ap.add_argument(
        "--optimizer",
        choices=["lmyard", "torch"],
        default="lmyard",
        help="lmyard: the trainer's AdamW, the clip's scale inside its step (lmyard.train.optim); torch: "
        "clip_grad_norm_ then torch's fused AdamW, as torchtitan does",
    )
    ap.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "fa4", "flash", "cudnn", "efficient", "math"],
        help="lmyard's model.attention: auto (PyTorch's choice), fa4 (FlashAttention-4), or one SDPA kernel",
    )
    ap.add_argument(
        "--doc-mask",
        choices=["off", "on", "both"],
        default="off",
        help="model.doc_mask: off (causal SDPA), on (block-causal FlexAttention over packed documents), or both",
    )
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length of --doc-mask runs (tokens)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation)")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="then N steps under torch.profiler: lmyard's step split (row key profile)",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--memory-gib",
        type=float,
        help="lmyard plans against this much GPU memory and its allocator is capped there (an 80 GB card on a "
        "larger one: 79.1)",
    )
    ap.add_argument("--titan", action="store_true", help="also run torchtitan 0.2.2 (run_torchtitan.py)")
    ap.add_argument(
        "--trainer", action="store_true", help="also run lmyard's trainer (torchrun -m lmyard.dispatch train)"
    )
    ap.add_argument("--titan-attn", default="sdpa", help="torchtitan's attention: sdpa (as lmyard) or flex")
    ap.add_argument(
        "--titan-ac",
        choices=["none", "selective", "full"],
        help="torchtitan's activation checkpointing (default: what lmyard applied, full for some blocks, none for "
        "pointwise)",
    )
    ap.add_argument("--titan-log", help="append torchtitan's whole output to this file")
    ap.add_argument("--json", type=Path, help="also write every row to this file (a JSON list)")
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "lmyard-bench-llama")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shard", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    if a.ac_blocks is not None and a.ac in ("none", "auto"):
        ap.error(f"--ac-blocks applies to --ac pointwise, selective or full, not {a.ac}: pass one or drop --ac-blocks")
    if a.memory_gib is not None and a.memory_gib <= 0:
        ap.error(f"--memory-gib is {a.memory_gib}: give the GPU memory to plan against in GiB, e.g. 79.1")
    if a.param_dtype == "bfloat16" and a.optimizer == "torch":
        ap.error("--param-dtype bfloat16 keeps its float32 masters in lmyard's AdamW: drop --optimizer torch")
    if a.worker:  # one precision per worker
        return worker(argparse.Namespace(**{**vars(a), "float8": a.float8[0]}))
    summary(run_all(a))


if __name__ == "__main__":
    main()
