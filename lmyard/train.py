"""The training loop: the torchrun entrypoint run on every node.

    torchrun --nproc_per_node=2 -m lmyard.train --spec spec.json

The spec (a JSON file, or the LMYARD_SPEC environment variable) holds the
run config, the shard set and the lineage. `train()` reads top to bottom:
set up -> resume -> loop { lr -> micro-steps -> clip -> step -> log ->
evaluate -> checkpoint }. It resumes from the newest complete checkpoint of
`runs/<run_name>` in the store, exactly: weights, AdamW state, step, data
cursor and every rank's RNG state.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lmyard import checkpoint
from lmyard.config import RunConfig, TrainConfig
from lmyard.data import TokenStream, TrainBatches, default_cache_dir, local_shards, val_sequences
from lmyard.errors import UserError
from lmyard.model import GPT, GPTConfig
from lmyard.shards import ShardSet
from lmyard.store import open_store
from lmyard.tracking import Lineage, MetricsSink, MLflowSink, NullSink

# Dense bf16 peak FLOP/s per GPU, for MFU (vendor datasheets, SXM parts, no sparsity).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to t.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at max_steps."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * coeff)


def setup_distributed(cfg: RunConfig) -> Dist:
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UserError("train.device is `cuda` but no GPU is visible; set train.device=cpu")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(cfg.train.threads_per_rank or max(1, (os.cpu_count() or 1) // local_world))
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return Dist(rank, local_rank, world, device)


def grad_accum_steps(cfg: RunConfig, world: int, seq_len: int) -> int:
    per_micro = cfg.train.micro_batch * seq_len * world
    if cfg.train.batch_tokens % per_micro:
        raise UserError(
            f"train.batch_tokens ({cfg.train.batch_tokens}) must be a multiple of micro_batch * block_size * "
            f"world size ({cfg.train.micro_batch} * {seq_len} * {world} = {per_micro}); "
            f"e.g. --set train.batch_tokens={per_micro * max(1, round(cfg.train.batch_tokens / per_micro))}")
    return cfg.train.batch_tokens // per_micro


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def all_mean(value: torch.Tensor, d: Dist) -> float:
    if d.world > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG if value.is_cuda else dist.ReduceOp.SUM)
        if not value.is_cuda:
            value /= d.world
    return float(value)


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, val: torch.Tensor, d: Dist, micro_batch: int, autocast) -> float:
    """Mean token loss over the fixed val sequences; each rank scores every world-th one."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=d.device)  # (loss sum, sequences)
    mine = val[d.rank::d.world]
    for i in range(0, mine.size(0), micro_batch):
        rows = mine[i:i + micro_batch].to(d.device)
        with autocast:
            _, loss = model(rows[:, :-1], rows[:, 1:])
        total += torch.tensor([float(loss) * rows.size(0), rows.size(0)], dtype=torch.float64, device=d.device)
    if d.world > 1:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def train(cfg: RunConfig, shards: ShardSet, lineage: Lineage | None, d: Dist, sink: MetricsSink) -> dict:
    t = cfg.train
    store = open_store(cfg.store)
    cache = default_cache_dir()

    # ---- model, optimizer, data -------------------------------------------------
    torch.manual_seed(t.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    gcfg = GPTConfig.from_config(cfg.model, shards.n_vocab)
    if gcfg.vocab_size < shards.n_vocab:
        raise UserError(f"model.vocab_size ({gcfg.vocab_size}) is smaller than the shard set's vocabulary "
                        f"({shards.n_vocab}, {shards.manifest['tokenizer']['name']}); unset it or raise it")
    raw_model = GPT(gcfg).to(d.device)
    T = gcfg.block_size
    accum = grad_accum_steps(cfg, d.world, T)
    cuda = d.device.type == "cuda"
    optimizer = torch.optim.AdamW(raw_model.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                  fused=cuda)
    train_data = TrainBatches(TokenStream(local_shards(shards, cfg.store, "train", cache)), T, t.micro_batch,
                              accum, d.rank, d.world)
    val = val_sequences(TokenStream(local_shards(shards, cfg.store, "val", cache)), T, cfg.eval.val_tokens)

    # ---- resume from the newest complete checkpoint -------------------------------
    step, cursor, tokens_seen = 0, 0, 0
    ckpt = checkpoint.load_latest(store, cfg.run_name, cache)
    steps_seen = [None] * d.world
    if d.world > 1:
        dist.all_gather_object(steps_seen, ckpt.step if ckpt else None)
        assert len(set(steps_seen)) == 1, f"ranks found different checkpoints: {steps_seen}"
    if ckpt is not None:
        raw_model.load_state_dict(ckpt.model)
        optimizer.load_state_dict(ckpt.optim)
        step, cursor, tokens_seen = ckpt.state["step"], ckpt.state["cursor"], ckpt.state["tokens_seen"]
        if ckpt.state["world_size"] == d.world:
            checkpoint.set_rng_state(ckpt.rng[d.rank])
        elif d.is_main:
            print(f"resuming on {d.world} ranks from a checkpoint of {ckpt.state['world_size']}: "
                  "the token stream continues, per-rank RNG states restart", flush=True)
        if d.is_main:
            print(f"resuming from {ckpt.uri} at step {step} ({tokens_seen:,} tokens seen)", flush=True)
    del ckpt

    model: torch.nn.Module = raw_model
    if t.compile if t.compile is not None else cuda:
        model = torch.compile(model)
    if d.world > 1:
        model = DDP(model, device_ids=[d.local_rank] if cuda else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    flops_tok = raw_model.flops_per_token()
    peak = peak_flops(d.device)
    if d.is_main:
        print(f"model: {raw_model.num_params():,} params, {gcfg.n_layer} layers, d={gcfg.n_embd}, T={T}, "
              f"vocab {gcfg.vocab_size} | {d.world} ranks on {d.device.type} | "
              f"{t.batch_tokens:,} tokens/step = {t.micro_batch} seq * {T} tokens * {d.world} ranks * {accum} "
              f"micro-steps", flush=True)

    def save(val_loss: float | None, train_loss: float | None) -> None:
        rng = [None] * d.world
        if d.world > 1:
            dist.all_gather_object(rng, checkpoint.rng_state())
        else:
            rng = [checkpoint.rng_state()]
        if d.is_main:
            state = {"step": step, "cursor": cursor, "tokens_seen": tokens_seen, "world_size": d.world,
                     "val_loss": val_loss, "train_loss": train_loss, "shard_address": shards.address,
                     "config": cfg.model_dump(mode="json"), "lineage": lineage.to_dict() if lineage else None,
                     "model": gcfg.__dict__}
            uri = checkpoint.save(store, cfg.run_name, step, raw_model.state_dict(), optimizer.state_dict(), rng, state)
            print(f"checkpoint step {step} -> {uri}", flush=True)
        if d.world > 1:
            dist.barrier()

    # ---- the loop -------------------------------------------------------------------
    val_loss = train_loss = None
    t_log, steps_since_log, wait_s = time.perf_counter(), 0, 0.0
    while step < t.max_steps:
        # learning rate for this step
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # forward/backward over the micro-steps; DDP syncs gradients on the last one only
        loss_sum = torch.zeros((), device=d.device)
        for micro in range(accum):
            t_wait = time.perf_counter()
            x, y = train_data.micro_batch(cursor, micro)
            x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
            wait_s += time.perf_counter() - t_wait
            sync = micro == accum - 1 or d.world == 1
            with (contextlib.nullcontext() if sync else model.no_sync()), autocast:
                _, loss = model(x, y)
            (loss / accum).backward()
            loss_sum += loss.detach()

        # clip, step
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        cursor += train_data.per_step
        tokens_seen += t.batch_tokens
        steps_since_log += 1

        # log
        last = step == t.max_steps
        if step % t.log_interval == 0 or last:
            train_loss = all_mean(loss_sum / accum, d)
            if not math.isfinite(train_loss):
                raise RuntimeError(f"training diverged: loss is {train_loss} at step {step}; lower train.lr "
                                   f"or resume from an earlier checkpoint")
            if cuda:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t_log) / steps_since_log
            tok_s = t.batch_tokens / dt
            metrics = {"train/loss": train_loss, "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tok_s,
                       "step_time_s": dt, "data_wait_frac": wait_s / (dt * steps_since_log), "tokens_seen": tokens_seen}
            if peak:
                metrics["mfu"] = tok_s * flops_tok / (peak * d.world)
            if cuda:
                metrics["peak_mem_gb"] = torch.cuda.max_memory_allocated(d.device) / 2**30
            if d.is_main:
                sink.log(metrics, step)
                print(f"step {step}/{t.max_steps} | loss {train_loss:.4f} | lr {lr:.2e} | grad {float(grad_norm):.3f} | "
                      f"{tok_s:,.0f} tok/s | {dt * 1000:.0f} ms/step" + (f" | mfu {metrics['mfu']:.1%}" if peak else ""),
                      flush=True)
            t_log, steps_since_log, wait_s = time.perf_counter(), 0, 0.0

        # evaluate
        if step % cfg.eval.interval == 0 or last:
            val_loss = evaluate_loss(model, val, d, t.micro_batch, autocast)
            if d.is_main:
                sink.log({"val/loss": val_loss}, step)
                print(f"step {step} | val loss {val_loss:.4f}", flush=True)
            t_log = time.perf_counter()

        # checkpoint
        if step % cfg.checkpoint.interval == 0 or last:
            save(val_loss, train_loss)
            t_log = time.perf_counter()

    return {"step": step, "tokens_seen": tokens_seen, "val_loss": val_loss, "train_loss": train_loss}


def read_spec(argv: list[str] | None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmyard.train", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="run spec JSON file (default: the LMYARD_SPEC environment variable)")
    args = parser.parse_args(argv)
    if args.spec:
        with open(args.spec) as f:
            return json.load(f)
    if "LMYARD_SPEC" in os.environ:
        return json.loads(os.environ["LMYARD_SPEC"])
    parser.error("give --spec PATH or set LMYARD_SPEC")


def main(argv: list[str] | None = None) -> int:
    spec = read_spec(argv)
    cfg = RunConfig.model_validate(spec["config"])
    shards = ShardSet.from_dict(spec["shards"])
    lineage = Lineage.from_dict(spec["lineage"]) if spec.get("lineage") else None
    d = setup_distributed(cfg)
    sink: MetricsSink = NullSink()
    try:
        if d.is_main and lineage is not None:
            sink = MLflowSink(lineage.tracking_uri, lineage.mlflow_run_id)
        result = train(cfg, shards, lineage, d, sink)
        if d.is_main:
            print("result " + json.dumps(result), flush=True)
        return 0
    except UserError as e:
        if d.is_main:
            print(f"lmyard: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        sink.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
