"""The train stage on every rank: `python -m lmyard.stages train` runs `train_stage` under torchrun.

    torchrun --nproc_per_node=8 -m lmyard.stages train --spec spec.json

The spec (lmyard.stages.TrainSpec: a JSON file, or the LMYARD_SPEC environment variable) holds the run
config, the shard set, the lineage, the lease and `hold_for_eval` (the flow evaluates every checkpoint and
applies retention itself). This rank joins the job (lmyard.train.distributed.setup_distributed), logs to the
lineage's MLflow run from rank 0, and runs the `Trainer` (lmyard.train.trainer). How the job ended goes to
`<exchange>/result.json` (any other failing rank: `failures/rank-R.json`) and the exit code
(lmyard.errors.ExitCode), never only to the log; `TrainRun` keeps what that failure path needs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmyard.config import RunConfig
from lmyard.errors import ExitCode, UserError
from lmyard.run import Run
from lmyard.stages import Exchange, TrainResult, TrainSpec, prefix_rank_lines, rank_exit, read_spec, run_stage
from lmyard.tracking.lease import Fence
from lmyard.tracking.lineage import LineageRef
from lmyard.tracking.sink import MetricsSink, NullSink, metrics_sink, system_metrics
from lmyard.train import kernel_warmup
from lmyard.train.components import Startup
from lmyard.train.distributed import Dist, setup_distributed
from lmyard.train.trainer import Trainer


@dataclass
class TrainRun:
    """What a failing train stage reports from: the trainer once it exists (its step, tokens and last checkpoint
    go into the result) and the metrics sink to close whatever happened."""

    trainer: Trainer | None = None
    sink: MetricsSink = field(default_factory=NullSink)

    def failed(self, code: ExitCode, message: str) -> TrainResult:
        return self.trainer.result(code, message) if self.trainer else TrainResult.ended(code, message)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.sink.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# The train runs of this process, kept until the interpreter exits. Freed as train_stage returns, a DDP model's
# reducer would destroy the gloo process group while that group's thread waits for the GIL to release a tensor
# of the last collective (torch's ProcessGroupGloo destructor joins its threads holding the GIL): a rank that
# hangs after its run has ended. At exit Python stops such threads before it frees what is left.
_KEPT: list[TrainRun] = []


def out_of_memory(e: BaseException, cfg: RunConfig, step: int) -> UserError | None:
    """A UserError naming the settings to change when `e` is an allocation failure, else None."""
    text = str(e)
    if not (
        isinstance(e, (torch.OutOfMemoryError, MemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    ):
        return None
    t = cfg.train
    return UserError(
        f"out of memory at step {step} with train.micro_batch={t.micro_batch} x model.block_size: "
        f"lower train.micro_batch (train.batch_tokens={t.batch_tokens} stays; gradient accumulation "
        "grows), or choose a smaller model"
    )


def node_system_metrics(cfg: RunConfig, lineage: LineageRef | None, d: Dist):
    """On each node's local rank 0: CPU, memory, disk, network and GPU metrics of this node, as
    `system/node<N>/...` in the lineage's run (N: torchrun's node rank, stable across attempts)."""
    if lineage is None or d.local_rank != 0 or not cfg.tracking.system_metrics:
        return contextlib.nullcontext()
    return system_metrics(
        lineage, node_id=f"node{os.environ.get('GROUP_RANK', '0')}", interval_s=cfg.tracking.system_metrics_interval_s
    )


def _train(spec_path: str | None, run: TrainRun) -> TrainResult:
    """The stage's body on one rank: setup, the Trainer, its result (`run` keeps what the failure path needs)."""
    startup = Startup()  # the trainer's entry: the launch part ends here
    spec = read_spec(TrainSpec, spec_path)
    cfg, lineage = spec.config, spec.lineage
    if cfg.train.device != "cpu":
        with startup.part("cuda"):  # the CUDA runtime, timed apart from the process group that follows
            if torch.cuda.is_available():
                torch.cuda.init()
    with startup.part("rendezvous"):
        d = setup_distributed(cfg)
    if d.world > 1 and d.local_rank == 0:  # one line per node: which ranks run where
        import socket

        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        print(f"{socket.gethostname()}: ranks {d.rank}-{d.rank + local - 1} of {d.world} joined", flush=True)
    run.sink = metrics_sink(lineage, d.is_main)  # rank 0 logs to MLflow; the others to nothing
    with node_system_metrics(cfg, lineage, d):
        handle = Run.of(cfg)  # the run's store, keys and this node's cache, opened once for the rank
        fence = Fence(handle, spec.lease) if spec.lease else None
        run.trainer = trainer = Trainer(spec, handle, d, run.sink, fence=fence, startup=startup)
        try:
            with kernel_warmup.started(trainer.gcfg, d.device, d.local_rank):  # compiled as the model compiles
                result = trainer.train()
        except Exception as e:
            oom = out_of_memory(e, cfg, trainer.state.step)
            if oom is None:
                raise
            raise oom from None
    if d.is_main:  # one line, not one per rank
        print(f"training finished at step {result.step}", flush=True)
    return result


def train_stage(spec_path: str | None = None) -> int:
    """`python -m lmyard.stages train` on every rank: rank 0 writes result.json, any other rank that fails
    writes failures/rank-R.json (lmyard.stages.run_stage, the one path from an exception to an exit code). The
    process's exit code is lmyard.stages.rank_exit's: under lmyard's torchrun a preempted rank exits 0, but its
    node's last."""
    run = TrainRun()
    _KEPT.append(run)
    exchange = Exchange.from_env()
    rank = int(os.environ.get("RANK", 0))  # torchrun's; the same as the process group's once it is set up
    prefix_rank_lines(rank)
    try:
        code = run_stage(
            lambda: _train(spec_path, run),
            exchange.path("result.json") if exchange and rank == 0 else None,
            failure_out=exchange.path("result.json" if rank == 0 else f"failures/rank-{rank}.json")
            if exchange
            else None,
            failed=run.failed,
            quiet=rank != 0,  # a bad config fails every rank alike: rank 0 says it once
            rank=rank,  # a crash: no traceback on the log, its last lines in the record (the launcher says it)
        )
    finally:
        run.close()
    return rank_exit(code)
