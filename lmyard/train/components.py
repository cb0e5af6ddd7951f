"""The Trainer's components. Each decides when it is due; the loop in lmyard.train only asks.

`MetricsLogger` (train metrics, progress.json), `Validator` (val loss), `Checkpointing` (saves, on schedule
and when preempted), `DivergenceGuard` (rollback or stop), `Preemption` (SIGTERM agreed on by every rank),
`FaultHook` (the injected failures of lmyard.faults), `Startup` (time to the first step, in parts) and `Goodput`
(the lineage's goodput and badput by cause).

Design notes: docs/training.md, `lmyard/train/components.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from lmyard import faults
from lmyard.config import RunConfig
from lmyard.errors import Diverged
from lmyard.stages import Exchange, Progress
from lmyard.stages.startup import AGENT_STARTED_ENV, RANK_STARTED_ENV, launched_at
from lmyard.tracking.schema import GOODPUT_METRICS, RESTART_METRICS

# Dense bf16 peak FLOP/s per GPU for MFU (vendor datasheets, SXM parts, no sparsity).
# MFU = tokens/s * flops_per_token / (peak * GPUs), flops_per_token = 6N + 12*L*d*T.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def all_mean(value: torch.Tensor, world: int) -> float:
    if world > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world
    return float(value)


class MetricsLogger:
    """Logs a window of steps: rates over the window, values of its last step."""

    def __init__(self, cfg: RunConfig, device: torch.device, world: int, flops_per_token: int, sink, is_main: bool):
        self.t, self.device, self.world, self.sink, self.is_main = cfg.train, device, world, sink, is_main
        self.flops_tok, self.peak = flops_per_token, peak_flops(device)
        self.exchange = Exchange.from_env() if is_main else None
        self.restart(0.0)

    def restart(self, waited_s: float) -> None:
        """Start a new window (after a pause: an evaluation, a checkpoint, a rollback)."""
        self.t0, self.steps, self.waited_at = time.perf_counter(), 0, waited_s

    def due(self, step: int) -> bool:
        return step % self.t.log_interval == 0

    def log(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        tokens_seen: int,
        waited_s: float,
        epoch: float | None = None,
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - self.t0) / max(1, self.steps)
        tok_s = self.t.batch_tokens / dt
        m = {
            "loss/train": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tok_s,
            "step_time_s": dt,
            "data_wait_frac": (waited_s - self.waited_at) / (dt * max(1, self.steps)),
            "tokens_seen": tokens_seen,
        }
        if epoch is not None:
            m["epoch"] = epoch
        if self.peak:
            m["mfu"] = tok_s * self.flops_tok / (self.peak * self.world)
        if self.device.type == "cuda":
            m["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.is_main:
            self.sink.log(m, step)
            print(
                f"step {step}/{self.t.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f} | "
                f"{tok_s:,.0f} tok/s | {dt * 1000:.1f} ms/step | data wait {m['data_wait_frac']:.2%}"
                + (f" | mfu {m['mfu']:.1%}" if self.peak else ""),
                flush=True,
            )
            if self.exchange:
                self.exchange.write(
                    "progress.json",
                    Progress(step=step, max_steps=self.t.max_steps, loss=loss, tokens_per_s=tok_s, mfu=m.get("mfu")),
                )
        self.restart(waited_s)


class Validator:
    def __init__(self, cfg: RunConfig):
        self.interval, self.max_steps = cfg.eval.interval, cfg.train.max_steps
        self.last: tuple[int, float] | None = None  # (step, val loss)

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.max_steps

    def at(self, step: int) -> float | None:
        """The val loss measured at exactly `step`, else None (a checkpoint never records a stale one)."""
        return self.last[1] if self.last and self.last[0] == step else None


class Checkpointing:
    def __init__(self, cfg: RunConfig):
        self.interval, self.max_steps = cfg.checkpoint.interval, cfg.train.max_steps

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.max_steps


class DivergenceGuard:
    """Decides whether a checked loss means divergence (non-finite, or a spike over the running mean)."""

    def __init__(self, cfg: RunConfig):
        g = cfg.train.guard
        self.policy, self.max_rollbacks, self.spike_factor = g.policy, g.max_rollbacks, g.spike_factor
        self.mean: float | None = None
        self.seen = 0

    def problem(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if self.spike_factor and self.mean is not None and self.seen >= 3 and loss > self.spike_factor * self.mean:
            return f"loss {loss:.4f} is over {self.spike_factor} x its running mean {self.mean:.4f}"
        self.mean = loss if self.mean is None else 0.9 * self.mean + 0.1 * loss
        self.seen += 1
        return None

    def check_rollback_allowed(self, step: int, problem: str, rollbacks: int) -> None:
        """Diverged when the policy or the cap says stop."""
        if self.policy == "stop":
            raise Diverged(
                f"training diverged at step {step}: {problem}. Resume from the last checkpoint with a "
                "lower train.lr, or set train.guard.policy=rollback"
            )
        if rollbacks >= self.max_rollbacks:
            raise Diverged(
                f"training diverged at step {step}: {problem}, after {rollbacks} rollbacks "
                f"(train.guard.max_rollbacks); lower train.lr"
            )


class Preemption:
    """SIGTERM -> checkpoint now and exit as preempted. Ranks agree on the step through a gloo group."""

    def __init__(self, world: int, cuda: bool):
        self.requested_at: float | None = None
        self.world = world
        # a CPU group for the flag: reading an NCCL result would make the CPU wait for the GPU every step
        self.group = dist.new_group(backend="gloo") if world > 1 and cuda else None
        self.previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            print(f"rank {os.environ.get('RANK', 0)}: SIGTERM received; checkpointing after this step", flush=True)

    def poll(self, failed: bool = False) -> tuple[bool, bool]:
        """(asked to stop, a checkpoint failed), the same on every rank: any rank's SIGTERM, any rank's `failed`
        (its background checkpoint writer stopped). One collective on the CPU group: call on every rank each step."""
        flags = torch.tensor([self.requested_at is not None, failed], dtype=torch.int32)
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])

    def barrier(self) -> None:
        """Every rank waits here for the others (collective): a preempted rank that has nothing to upload waits
        for the ranks that commit, so no rank exits while a commit is under way."""
        if self.world > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)


class FaultHook:
    """LMYARD_FAULTS drills around a step: `hang_before` and `hang` stop the last rank, `kill` and `crash_last`
    end it, `crash` exits once checkpoints are in."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def poison(self, step: int) -> bool:
        return faults.fires("nan_loss", step)

    def before_step(self, step: int) -> None:
        if self.rank == self.world - 1 and faults.fires("hang_before", step):
            print(f"injected hang of rank {self.rank} before step {step}", flush=True)
            time.sleep(1e6)

    def after_step(self, step: int, flush) -> None:
        faults.delay("pause", step, "LMYARD_FAULT_PAUSE_S", 5)  # every rank: a window in which a drill acts
        if self.rank == self.world - 1 and faults.fires("hang", step):
            print(f"injected hang of rank {self.rank} after step {step}", flush=True)
            time.sleep(1e6)
        if self.rank == self.world - 1 and faults.fires("kill", step):
            print(f"injected SIGKILL of rank {self.rank} after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == self.world - 1 and faults.fires("crash_last", step):
            print(f"injected crash of rank {self.rank} after step {step}", flush=True)
            os._exit(1)  # the others fail on the broken collective: the first cause is this rank's
        if faults.fires("crash", step):
            flush()  # crash at a reproducible point: earlier checkpoints committed
            print(f"injected crash after step {step}", flush=True)
            os._exit(1)


class Startup:
    """The restart to the first step's end, in parts, once per attempt (rank 0 reports: `system/restart/<part>_s`
    metrics at the attempt's first step, and one line). The parts, in the order they happen:

    - torchrun: from the launch (lmyard.stages.startup.launched_at: the launcher's time, torchrun's start or this
      process's) to this rank's process start: torchrun's own start and its agent;
    - imports: from this process's start to the train stage's entry, when this is made (the interpreter, imports);
    - cuda: the CUDA runtime's initialisation; rendezvous: the process group (NCCL's communicators on CUDA);
    - model: the model built, sharded and wrapped, its optimizer made; data: the loader set up and the time the
      first step waited for its first batch;
    - resume: the CheckpointManager's load; compile_cache: the compiled code loaded from the run's store;
    - compile: the first step's time over the second's (torch.compile, autotuning, first allocations), less the
      data wait; first_step: the second step's time, a steady one; other: the rest.

    Reported after the second step, or at the end of an attempt that ran one step (its compile is then in
    first_step). The parts sum to the total. Each is a few clock reads: always on."""

    PARTS = (
        "torchrun",
        "imports",
        "cuda",
        "rendezvous",
        "model",
        "data",
        "resume",
        "compile_cache",
        "compile",
        "first_step",
        "other",
    )

    def __init__(self) -> None:
        self.launched, self.launched_by = launched_at()
        self.entered = time.perf_counter()
        now = time.time()
        born = process_start(self.launched)
        self.parts = dict.fromkeys(self.PARTS[:-3], 0.0)  # compile, first_step, other: from the steps
        self.parts["torchrun"] = max(0.0, born - self.launched)
        self.parts["imports"] = max(0.0, now - max(born, self.launched))
        self.steps: list[float] = []  # the first two steps' times
        self.first_wait = 0.0  # what the first step waited for its batches
        self.first_end = 0.0  # perf_counter at the first step's end
        self.reported = False

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] += time.perf_counter() - t0

    @contextlib.contextmanager
    def step(self, device: torch.device, batches=None) -> Iterator[None]:
        """Times one of the first two steps to its end on the device (a synchronize for each of those two);
        `batches` (with `waited_s`): the first step's wait for data counts as the data part."""
        if len(self.steps) >= 2:
            yield
            return
        waited = batches.waited_s if batches is not None else 0.0
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        if not self.steps and batches is not None:
            self.first_wait = batches.waited_s - waited
        self.steps.append(end - t0)
        self.first_end = self.first_end or end

    def times(self) -> dict[str, float] | None:
        """Each part and the total in seconds; None before the first step has ended."""
        if not self.steps:
            return None
        first = self.steps[0] - self.first_wait
        steady = self.steps[1] if len(self.steps) > 1 else first
        times = {**self.parts, "compile": max(0.0, first - steady), "first_step": min(first, steady)}
        times["data"] += self.first_wait
        total = self.parts["torchrun"] + self.parts["imports"] + self.first_end - self.entered
        times["other"] = max(0.0, total - sum(times.values()))
        return {**times, "total": total}

    def report(self, step: int, sink, is_main: bool, final: bool = False) -> None:
        """Once: after the second step, or (`final`) at the attempt's end when only one step ran. The metrics go
        at the attempt's first step."""
        if self.reported or not self.steps or (len(self.steps) < 2 and not final):
            return  # every step asks: the check comes before any work
        times = self.times()
        assert times is not None
        self.reported = True
        first = step - len(self.steps) + 1
        if is_main:
            sink.log({f"{RESTART_METRICS}{k}_s": v for k, v in times.items()}, first)
            parts = " + ".join(f"{k.replace('_', ' ')} {times[k]:.2f} s" for k in self.PARTS)
            print(
                f"startup to the end of step {first}: {times['total']:.2f} s = {parts} "
                f"(launch from {self.launched_by}'s start" + _standbys(),
                flush=True,
            )
            note = missing_bytecode()
            if note:
                print(note, flush=True)


def _standbys() -> str:
    """The startup line's end: which of this rank and its torchrun started in a warm standby."""
    rank, agent = RANK_STARTED_ENV in os.environ, AGENT_STARTED_ENV in os.environ
    if rank and agent:
        return "; torchrun and the rank in warm standbys)"
    if rank:
        return "; in a warm standby)"
    return "; torchrun in a warm standby)" if agent else ")"


def missing_bytecode() -> str | None:
    """A line when torch was imported from its sources with no bytecode beside them, none written (the environment
    sets PYTHONDONTWRITEBYTECODE, or the install is read-only): every process then compiles torch's modules again
    at its start, seconds of each restart (about 10 s of a GPU node's fresh-node restart). None when it has it."""
    cached = getattr(torch, "__cached__", None)
    if not cached or os.path.exists(cached):
        return None
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return (
        f"torch has no bytecode in {site} and none is written here, so every start compiles its modules again "
        f"(seconds of each restart): run `python -m compileall -q -j 0 {site}` once"
    )


def process_start(launched: float) -> float:
    """This rank's start (Unix seconds): its process's, or where a warm standby runs it (lmyard.launch.standby),
    when torchrun started the process that handed it over; `launched` where it cannot be read."""
    import psutil

    with contextlib.suppress(KeyError, ValueError):
        return float(os.environ[RANK_STARTED_ENV])
    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return launched


CAUSES = ("start", "restart", "steps_lost", "checkpoint", "evaluation")


class Goodput:
    """One attempt's share of the lineage's goodput and badput by cause, kept up to date in its MLflow run as
    `system/goodput/*`; only rank 0 makes records.

    Goodput is the share of the lineage's time spent in steps whose results survive; the rest is badput, by cause:

        start        the first attempt's launch to its first step (torchrun, imports, set-up, compile)
        restart      every later attempt's launch to its first step (`Startup`)
        steps_lost   steps an attempt ran past the checkpoint the next attempt resumed from, at their mean time
        checkpoint   the time the loop was blocked by checkpoint saves
        evaluation   the in-loop validation

    The time is the attempts' own: from each launch to its last record (at every log step, at a preemption and at
    the end), summed over the attempts; a retry's wait between attempts is not in it. Each record carries the
    lineage's totals so far; an attempt starts from the totals the last one recorded (the run's latest values) and
    moves the steps it runs again from goodput to `steps_lost`. The points' step is the lineage's count of steps
    run, repeats included: it only grows, so the latest point is always the newest record.
    """

    def __init__(self, sink, launched: float, is_main: bool):
        self.sink, self.launched, self.is_main = sink, launched, is_main
        self.prev: dict[str, float] = {}
        self.blocked = {"checkpoint": 0.0, "evaluation": 0.0}

    def begin(self, start_step: int) -> None:
        """The totals the lineage's earlier attempts recorded; steps past `start_step` count as lost."""
        if not self.is_main:
            return
        latest = getattr(self.sink, "latest", None)
        prev = latest(GOODPUT_METRICS) if latest else {}
        self.prev = {k.removeprefix(GOODPUT_METRICS): v for k, v in prev.items()}
        reached = int(self.prev.get("step", 0))
        if reached > start_step and self.prev.get("productive_s"):
            lost = (reached - start_step) * self.prev["productive_s"] / reached
            self.prev["productive_s"] -= lost
            self.prev["badput/steps_lost_s"] = self.prev.get("badput/steps_lost_s", 0.0) + lost

    def blocked_by(self, cause: str, seconds: float) -> None:
        self.blocked[cause] += seconds

    def record(self, step: int, steps_run: int, startup: Startup) -> dict[str, float]:
        """The lineage's totals now, after this attempt's `steps_run` steps (`startup`: its launch to its first step,
        less the steady step in it)."""
        if not self.is_main:
            return {}
        times = startup.times()
        startup_s = times["total"] - times["first_step"] if times else None
        p = self.prev
        wall = time.time() - self.launched
        starting = wall if startup_s is None else min(startup_s, wall)
        mine = max(0.0, wall - starting - sum(self.blocked.values()))
        first = not p  # no earlier record: this is the lineage's start
        badput = {c: p.get(f"badput/{c}_s", 0.0) for c in CAUSES}
        badput["start" if first else "restart"] += starting
        badput["checkpoint"] += self.blocked["checkpoint"]
        badput["evaluation"] += self.blocked["evaluation"]
        total = p.get("wall_s", 0.0) + wall
        productive = p.get("productive_s", 0.0) + mine
        values = {
            "wall_s": total,
            "productive_s": productive,
            "goodput": productive / total if total > 0 else 0.0,
            "step": float(step),
            "steps_run": p.get("steps_run", 0.0) + steps_run,
            **{f"badput/{c}_s": v for c, v in badput.items()},
        }
        self.sink.log({GOODPUT_METRICS + k: v for k, v in values.items()}, int(values["steps_run"]))
        return values
