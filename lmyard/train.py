"""The training loop: the torchrun entrypoint run on every node.

    torchrun --nproc_per_node=8 -m lmyard.train --spec spec.json

The spec (a JSON file, or the LMYARD_SPEC environment variable) holds the
run config, the shard set, the lineage and `hold_for_eval` (the flow evaluates
every checkpoint and applies retention itself). `train()` reads top to bottom:
set up -> resume -> loop { lr -> micro-steps -> clip -> step -> check & log
-> evaluate -> checkpoint }. It resumes from the newest complete checkpoint
of `runs/<run_name>` in the store, exactly: weights, AdamW state, step, data
cursor and every rank's RNG state. Imports stay light (no mlflow or boto3
until used) so the entrypoint starts fast on GPU nodes.
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

from lmyard import checkpoint, faults, retention
from lmyard.checkpoint import AsyncCheckpointer, StoreOutage
from lmyard.config import RunConfig, TrainConfig
from lmyard.data import Prefetcher, TrainBatches, default_cache_dir, split_stream, val_sequences
from lmyard.errors import UserError
from lmyard.model import GPT, GPTConfig
from lmyard.shards import ShardSet
from lmyard.store import open_store
from lmyard.tracking import Lineage, MetricsSink, MLflowSink, NullSink, system_metrics
from lmyard.watchdog import Heartbeat

# Dense bf16 peak FLOP/s per GPU for MFU (vendor datasheets, SXM parts, no sparsity).
# MFU = tokens/s * flops_per_token / (peak * GPUs), flops_per_token = 6N + 12*L*d*T.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12,
              "L40S": 362e12, "L4": 121e12, "A10": 125e12}

# How long a rollback waits for the last good checkpoint to reach the store before it gives up with
# StoreOutage (the other ranks wait at a barrier meanwhile; NCCL's default collective timeout is 10 min).
FLUSH_TIMEOUT_S = 300.0


class Diverged(RuntimeError):
    """The loss became non-finite or spiked, and the guard's policy stops the run."""


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


def check_fits(model: GPT, micro_batch: int, device: torch.device) -> None:
    """Refuse, before the first step, a model whose weights, grads and AdamW state exceed the GPU's memory."""
    if device.type != "cuda":
        return
    c = model.config
    static = model.num_params() * 16  # fp32 weights + grads + two AdamW moments
    # bf16 activations kept for backward: ~34 bytes per token per layer per width unit with flash
    # attention (Korthikanti et al. 2022), plus bf16 logits and their fp32 softmax.
    activations = c.n_layer * micro_batch * c.block_size * c.n_embd * 34 + micro_batch * c.block_size * c.vocab_size * 6
    free, total = torch.cuda.mem_get_info(device)
    gib = 2**30
    if static > free:
        raise UserError(f"the model's weights, gradients and AdamW state need {static / gib:.1f} GiB but "
                        f"{torch.cuda.get_device_name(device)} has {free / gib:.1f} GiB free of {total / gib:.1f}: "
                        "choose a smaller model.preset")
    if static + activations > free:
        print(f"warning: this step may not fit: ~{(static + activations) / gib:.1f} GiB estimated, "
              f"{free / gib:.1f} GiB free; lower train.micro_batch (batch_tokens stays, accumulation grows)",
              flush=True)


def all_mean(value: torch.Tensor, d: Dist) -> float:
    if d.world > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
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
            loss = model(rows[:, :-1], rows[:, 1:])
        total[0] += loss.double() * rows.size(0)
        total[1] += rows.size(0)
    if d.world > 1:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


class ComputeContext:
    """bf16 autocast on CUDA, and the configured SDPA kernel; reusable across steps."""

    def __init__(self, cuda: bool, attention: str):
        self.cuda, self.attention = cuda, attention

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        if self.cuda:
            self.stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        if self.attention != "auto":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                       "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[self.attention]
            self.stack.enter_context(sdpa_kernel(backend))
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def prepare_model(raw_model: torch.nn.Module, cfg: RunConfig, d: Dist) -> tuple[torch.nn.Module, ComputeContext]:
    """The model as the training step runs it: DDP (more than one rank), then torch.compile (default on
    CUDA); and the autocast context for its forward, with TF32 matmuls on CUDA.

    DDP first, then compile: dynamo splits the compiled graph at DDP's bucket boundaries, so each bucket's
    all-reduce overlaps the rest of backward (compiling the bare model makes backward one opaque graph whose
    gradients all arrive at its end).
    """
    t, cuda = cfg.train, d.device.type == "cuda"
    model = raw_model
    if d.world > 1:
        model = DDP(model, device_ids=[d.local_rank] if cuda else None, gradient_as_bucket_view=True,
                    bucket_cap_mb=t.ddp_bucket_mb)
    if t.compile if t.compile is not None else cuda:
        model = torch.compile(model)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return model, ComputeContext(cuda, cfg.model.attention)


def new_data_cursor(state: dict, data: TrainBatches, d: Dist) -> int:
    """Where a lineage continues when its shard set changed (retraining on new data).

    An append-only source keeps the old train stream as a prefix of the new one:
    continue at the first sequence past the old tokens. Otherwise start the new stream.
    """
    old_tokens = state.get("train_tokens") or 0
    first_new = old_tokens // data.T
    if 0 < old_tokens < data.stream.total and first_new < data.n_seq:
        where, cursor = f"at the first sequence past its {old_tokens:,} tokens (the data that is new)", first_new
    else:
        where, cursor = "from the start of the new shard set", 0
    if d.is_main:
        print(f"the shard set changed from {state['shard_address']} to this run's: continuing {where}", flush=True)
    return cursor


def train_step(model: torch.nn.Module, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
               next_batch, accum: int, lr: float, grad_clip: float, autocast, distributed: bool,
               poison: bool = False, before_update=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `accum` micro-batches; returns (mean loss, grad norm) as device tensors."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = None
    for micro in range(accum):
        x, y = next_batch()
        sync = micro == accum - 1 or not distributed  # DDP all-reduces gradients on the last micro-step only
        with (contextlib.nullcontext() if sync else model.no_sync()), autocast:
            loss = model(x, y)
        if poison:
            loss = loss * float("nan")
        (loss / accum).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if before_update is not None:
        before_update()  # a checkpoint copy of the weights in flight must finish before they change
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum, grad_norm


class Guard:
    """Decides whether a checked loss means divergence (non-finite, or a spike over the running mean)."""

    def __init__(self, spike_factor: float | None):
        self.spike_factor, self.mean, self.seen = spike_factor, None, 0

    def bad(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if self.spike_factor and self.mean is not None and self.seen >= 3 and loss > self.spike_factor * self.mean:
            return f"loss {loss:.4f} is over {self.spike_factor} x its running mean {self.mean:.4f}"
        self.mean = loss if self.mean is None else 0.9 * self.mean + 0.1 * loss
        self.seen += 1
        return None


def train(cfg: RunConfig, shards: ShardSet, lineage: Lineage | None, d: Dist, sink: MetricsSink,
          hold_for_eval: bool = False) -> dict:
    """Train to cfg.train.max_steps. `hold_for_eval`: the flow evaluates every checkpoint and applies retention
    itself after each evaluation (one deleter; no checkpoint removed before it is evaluated)."""
    t = cfg.train
    store = open_store(cfg.store)
    cache = default_cache_dir()
    cuda = d.device.type == "cuda"

    # ---- model, optimizer, data -------------------------------------------------
    torch.manual_seed(t.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    gcfg = GPTConfig.from_config(cfg.model, shards.n_vocab)
    if gcfg.vocab_size < shards.n_vocab:
        raise UserError(f"model.vocab_size ({gcfg.vocab_size}) is smaller than the shard set's vocabulary "
                        f"({shards.n_vocab}, {shards.manifest['tokenizer']['name']}); unset it or raise it")
    raw_model = GPT(gcfg)
    check_fits(raw_model, t.micro_batch, d.device)
    raw_model.to(d.device)
    T = gcfg.block_size
    accum = grad_accum_steps(cfg, d.world, T)
    optimizer = torch.optim.AdamW(raw_model.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                  fused=cuda)
    train_data = TrainBatches(split_stream(shards, cfg.store, "train", cache), T, t.micro_batch, accum,
                              d.rank, d.world)
    val = val_sequences(split_stream(shards, cfg.store, "val", cache), T, cfg.eval.val_tokens)

    # ---- resume from the newest complete checkpoint -------------------------------
    step, cursor, tokens_seen = 0, 0, 0

    def restore(ckpt: checkpoint.Checkpoint) -> None:
        nonlocal step, tokens_seen
        raw_model.load_state_dict(ckpt.model)
        optimizer.load_state_dict(ckpt.optim)
        step, tokens_seen = ckpt.state["step"], ckpt.state["tokens_seen"]
        if ckpt.state["world_size"] == d.world:
            checkpoint.set_rng_state(ckpt.rng[d.rank])
        elif d.is_main:
            print(f"resuming on {d.world} ranks from a checkpoint of {ckpt.state['world_size']}: "
                  "the token stream continues, per-rank RNG states restart", flush=True)

    ckpt = checkpoint.load_latest(store, cfg.run_name, cache)
    if d.world > 1:
        found = [None] * d.world
        dist.all_gather_object(found, ckpt.step if ckpt else None)
        assert len(set(found)) == 1, f"ranks found different checkpoints: {found}"
    if ckpt is not None:
        restore(ckpt)
        cursor = ckpt.state["cursor"]
        if d.is_main:
            print(f"resuming from {ckpt.uri} at step {step} ({tokens_seen:,} tokens seen)", flush=True)
        if ckpt.state["shard_address"] != shards.address:
            cursor = new_data_cursor(ckpt.state, train_data, d)
    del ckpt

    model, autocast = prepare_model(raw_model, cfg, d)
    params = list(raw_model.parameters())
    flops_tok = raw_model.flops_per_token()
    peak = peak_flops(d.device)
    if d.is_main:
        print(f"model: {raw_model.num_params():,} params, {gcfg.n_layer} layers, d={gcfg.n_embd}, T={T}, "
              f"vocab {gcfg.vocab_size} | {d.world} ranks on {d.device.type} | "
              f"{t.batch_tokens:,} tokens/step = {t.micro_batch} seq * {T} tokens * {d.world} ranks * {accum} "
              f"micro-steps", flush=True)

    def committed(s: int, uri: str) -> None:
        print(f"checkpoint step {s} committed -> {uri}", flush=True)
        if not hold_for_eval:  # else the flow applies retention as it finishes evaluating each checkpoint
            retention.apply(store, cfg.run_name, cfg.checkpoint)

    checkpointer = AsyncCheckpointer(
        store, cfg.run_name, os.path.join(cache, "staging"), max_pending=cfg.checkpoint.max_pending,
        retries=cfg.checkpoint.upload_retries, on_commit=committed) if d.is_main else None

    def save(val_loss: float | None, train_loss: float | None) -> None:
        """Every rank hands in its RNG state; rank 0 snapshots the state and returns (upload in background)."""
        rng = [None] * d.world
        if d.world > 1:
            dist.all_gather_object(rng, checkpoint.rng_state())
        else:
            rng = [checkpoint.rng_state()]
        if checkpointer is not None:
            sink.flush(timeout=30)  # metrics up to this step reach MLflow before the checkpoint exists: a resume skips them
            state = {"step": step, "cursor": cursor, "tokens_seen": tokens_seen, "world_size": d.world,
                     "val_loss": val_loss, "train_loss": train_loss, "shard_address": shards.address,
                     "train_tokens": train_data.stream.total,
                     "config": cfg.model_dump(mode="json"), "lineage": lineage.to_dict() if lineage else None,
                     "model": gcfg.__dict__, "rollbacks": rollbacks}
            blocked = checkpointer.save(raw_model.state_dict(), optimizer.state_dict(), rng, state)
            print(f"checkpoint step {step} saving in the background (loop blocked {blocked * 1000:.1f} ms)", flush=True)
            sink.log({"checkpoint/blocked_s": blocked}, step)

    # ---- the loop -------------------------------------------------------------------
    batches = Prefetcher(train_data, cursor, d.device)
    guard, rollbacks, steps_run = Guard(t.guard.spike_factor), 0, 0
    heartbeat = Heartbeat(d.rank)
    val_loss = train_loss = None
    t_log, steps_since_log, wait_at_log = time.perf_counter(), 0, 0.0
    try:
        while step < t.max_steps:
            # one optimizer step: lr, micro-steps, clip, AdamW
            lr = lr_at(step, t)
            loss, grad_norm = train_step(model, params, optimizer, batches.get, accum, lr, t.grad_clip, autocast,
                                         d.world > 1, poison=faults.fires("nan_loss", step + 1),
                                         before_update=checkpointer.before_update if checkpointer else None)
            if checkpointer is not None and steps_run == 0:  # optimizer state exists now: make copy buffers
                checkpointer.prepare(raw_model.state_dict(), optimizer.state_dict())
            steps_run += 1
            step += 1
            heartbeat.beat(step)
            cursor += train_data.per_step
            tokens_seen += t.batch_tokens
            steps_since_log += 1
            last = step == t.max_steps
            checkpoint_due = step % cfg.checkpoint.interval == 0 or last

            # check the loss (and log) on log steps, and always before a checkpoint
            if step % t.log_interval == 0 or checkpoint_due:
                train_loss = all_mean(loss, d)
                problem = guard.bad(train_loss)
                if problem:
                    if checkpointer is not None:
                        checkpointer.flush(FLUSH_TIMEOUT_S)  # the last good checkpoint may still be uploading
                    if d.world > 1:
                        dist.barrier()
                    ckpt = _rollback_target(cfg, t, store, cache, step, problem, rollbacks, d)
                    rollbacks += 1
                    bad_step, skipped = step, cursor - ckpt.state["cursor"]
                    restore(ckpt)
                    batches.reset(cursor)  # the data cursor stays: the batches since the checkpoint are skipped
                    if d.is_main:
                        sink.log({"guard/rollbacks": rollbacks, "guard/skipped_sequences": skipped}, bad_step)
                        print(f"divergence at step {bad_step}: {problem}; rolled back to {ckpt.uri} (step {ckpt.step}), "
                              f"skipping {skipped} sequences; rollback {rollbacks} of {t.guard.max_rollbacks}", flush=True)
                    del ckpt
                    t_log, steps_since_log, wait_at_log = time.perf_counter(), 0, batches.waited_s
                    continue
                if cuda:
                    torch.cuda.synchronize()
                dt = (time.perf_counter() - t_log) / steps_since_log
                tok_s = t.batch_tokens / dt
                metrics = {"train/loss": train_loss, "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tok_s,
                           "step_time_s": dt, "data_wait_frac": (batches.waited_s - wait_at_log) / (dt * steps_since_log),
                           "tokens_seen": tokens_seen}
                if peak:
                    metrics["mfu"] = tok_s * flops_tok / (peak * d.world)
                if cuda:
                    metrics["peak_mem_gb"] = torch.cuda.max_memory_allocated(d.device) / 2**30
                if d.is_main:
                    sink.log(metrics, step)
                    print(f"step {step}/{t.max_steps} | loss {train_loss:.4f} | lr {lr:.2e} | grad {float(grad_norm):.3f} | "
                          f"{tok_s:,.0f} tok/s | {dt * 1000:.1f} ms/step | data wait {metrics['data_wait_frac']:.2%}"
                          + (f" | mfu {metrics['mfu']:.1%}" if peak else ""), flush=True)
                t_log, steps_since_log, wait_at_log = time.perf_counter(), 0, batches.waited_s

            # evaluate
            if step % cfg.eval.interval == 0 or last:
                val_loss = evaluate_loss(model, val, d, t.micro_batch, autocast)
                if d.is_main:
                    sink.log({"val/loss": val_loss}, step)
                    print(f"step {step} | val loss {val_loss:.4f}", flush=True)
                t_log = time.perf_counter()

            # checkpoint
            if checkpoint_due:
                save(val_loss, train_loss)
                t_log = time.perf_counter()

            if d.rank == d.world - 1 and faults.fires("hang", step):
                print(f"injected hang of rank {d.rank} after step {step}", flush=True)
                time.sleep(1e6)
            if faults.fires("crash", step):
                if checkpointer is not None:  # crash at a reproducible point: earlier checkpoints committed
                    checkpointer.flush(FLUSH_TIMEOUT_S)
                print(f"injected crash after step {step}", flush=True)
                os._exit(1)
    except BaseException:
        if checkpointer is not None:  # let committed-so-far uploads finish, but do not hang on a dead store
            with contextlib.suppress(Exception):
                checkpointer.close(timeout_s=60)
        raise
    finally:
        batches.close()
    if checkpointer is not None:
        checkpointer.close()  # wait for the last upload
    if d.world > 1:
        dist.barrier()

    return {"step": step, "tokens_seen": tokens_seen, "val_loss": val_loss, "train_loss": train_loss,
            "rollbacks": rollbacks}


def _rollback_target(cfg: RunConfig, t: TrainConfig, store, cache: str, step: int, problem: str, rollbacks: int,
                     d: Dist) -> checkpoint.Checkpoint:
    """The checkpoint to roll back to, or Diverged when the policy or the cap says stop."""
    if t.guard.policy == "stop":
        raise Diverged(f"training diverged at step {step}: {problem}. Resume from the last checkpoint with a lower "
                       "train.lr, or set train.guard.policy=rollback")
    if rollbacks >= t.guard.max_rollbacks:
        raise Diverged(f"training diverged at step {step}: {problem}, after {rollbacks} rollbacks "
                       f"(train.guard.max_rollbacks); lower train.lr")
    ckpt = checkpoint.load_latest(store, cfg.run_name, cache)
    if ckpt is None:
        raise Diverged(f"training diverged at step {step}: {problem}, and there is no checkpoint to roll back to; "
                       "lower train.lr or checkpoint.interval")
    return ckpt


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


def node_system_metrics(cfg: RunConfig, lineage: Lineage | None, d: Dist):
    """On each node's local rank 0: CPU, memory, disk, network and GPU metrics of this node, as
    `system/node<N>/...` in the lineage's run (N: torchrun's node rank, stable across attempts)."""
    if lineage is None or d.local_rank != 0 or not cfg.tracking.system_metrics:
        return contextlib.nullcontext()
    return system_metrics(lineage, node_id=f"node{os.environ.get('GROUP_RANK', '0')}",
                          interval_s=cfg.tracking.system_metrics_interval_s)


def main(argv: list[str] | None = None) -> int:
    spec = read_spec(argv)
    cfg = RunConfig.model_validate(spec["config"])
    shards = ShardSet.from_dict(spec["shards"])
    lineage = Lineage.from_dict(spec["lineage"]) if spec.get("lineage") else None
    d = setup_distributed(cfg)
    if d.world > 1 and d.local_rank == 0:  # one line per node: which ranks run where
        import socket

        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        print(f"{socket.gethostname()}: ranks {d.rank}-{d.rank + local - 1} of {d.world} joined", flush=True)
    sink: MetricsSink = NullSink()
    try:
        if d.is_main and lineage is not None:
            sink = MLflowSink(lineage.tracking_uri, lineage.mlflow_run_id)
        with node_system_metrics(cfg, lineage, d):
            result = train(cfg, shards, lineage, d, sink, hold_for_eval=spec.get("hold_for_eval", False))
        if d.is_main:
            print("result " + json.dumps(result), flush=True)
        return 0
    except (UserError, Diverged, StoreOutage) as e:
        if d.is_main:
            print(f"lmyard: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        sink.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
